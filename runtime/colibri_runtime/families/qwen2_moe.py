"""Qwen2-MoE (Qwen1.5-MoE): QKV biases, softmax top-k routing, a shared expert scaled by
sigmoid(shared_expert_gate(x))."""

from __future__ import annotations

from . import _common as c
from . import qwen3_moe

MODEL_TYPE = "qwen2_moe"


def build(config, weights, experts):
    n_experts = c.num_experts(config)
    spec = c.AttentionSpec(qk_norm=None, qkv_bias=bool(config.get("qkv_bias", True)))
    layers = []
    for i in range(int(config["num_hidden_layers"])):
        p = f"model.layers.{i}.mlp"
        if qwen3_moe.is_sparse(config, i):
            router = c.softmax_router(config, weights, f"{p}.gate.weight", n_experts,
                                      bool(config.get("norm_topk_prob", False)))
            shared = gate = None
            if weights.first(f"{p}.shared_expert.gate_proj.weight"):
                shared = c.swiglu(config, weights, f"{p}.shared_expert")
                gate = weights.linear(f"{p}.shared_expert_gate")
            ffn = c.moe(config, i, router, experts, shared, gate)
        else:
            ffn = c.swiglu(config, weights, p)
        attn = c.attention(config, weights, i, spec, qwen3_moe.sliding_window(config, i))
        layers.append(c.layer(c.norms(config, weights, i), attn, ffn))
    return c.assemble(MODEL_TYPE, config, weights, experts, layers)
