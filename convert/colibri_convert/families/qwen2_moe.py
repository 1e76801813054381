"""Qwen2-MoE (`qwen2_moe`): attention with q/k/v biases; MoE layers with a router, routed experts, one shared expert
and its sigmoid gate (`shared_expert_gate`, kept f32 with the routers); `mlp_only_layers` are dense."""

from __future__ import annotations

from ._base import ModelPlan, PlanBuilder, num_experts

MODEL_TYPE = "qwen2_moe"


def is_sparse(config: dict, n: int) -> bool:
    step = int(config.get("decoder_sparse_step") or 1)
    return n not in (config.get("mlp_only_layers") or []) and num_experts(config) > 0 and (n + 1) % step == 0


def plan(config: dict) -> ModelPlan:
    b = PlanBuilder(MODEL_TYPE, config)
    bias = bool(config.get("qkv_bias", True))
    e = num_experts(config)
    for_shared = int(config.get("shared_expert_intermediate_size") or 0)
    b.embeddings_and_head()
    for n in range(int(config["num_hidden_layers"])):
        p = f"model.layers.{n}."
        b.layer_norms(p)
        b.gqa_attention(p, q_bias=bias, k_bias=bias, v_bias=bias, o_bias=False, qk_norm=None)
        if not is_sparse(config, n):
            b.gated_mlp(p + "mlp.", int(config["intermediate_size"]), "dense_mlp")
            continue
        b.add(p + "mlp.gate.weight", (e, b.hidden), "router")
        if for_shared:
            b.gated_mlp(p + "mlp.shared_expert.", for_shared, "shared_experts")
            b.add(p + "mlp.shared_expert_gate.weight", (1, b.hidden), "router")
        b.experts(n, p + "mlp.experts")
    return b.build()
