"""OLMoE: softmax top-k routing (norm_topk_prob), q/k RMSNorm over the whole projection, optional QKV clipping."""

from __future__ import annotations

from . import _common as c

MODEL_TYPE = "olmoe"


def build(config, weights, experts):
    n_experts = c.num_experts(config)
    spec = c.AttentionSpec(qk_norm="full")
    layers = []
    for i in range(int(config["num_hidden_layers"])):
        router = c.softmax_router(config, weights, f"model.layers.{i}.mlp.gate.weight", n_experts,
                                  bool(config.get("norm_topk_prob", False)))
        layers.append(c.layer(c.norms(config, weights, i), c.attention(config, weights, i, spec),
                              c.moe(config, i, router, experts)))
    return c.assemble(MODEL_TYPE, config, weights, experts, layers)
