"""Qwen3-MoE (`qwen3_moe`): attention with per-head q/k RMS norms; MoE layers with router and routed experts (no
shared expert); `mlp_only_layers` / `decoder_sparse_step` layers are dense."""

from __future__ import annotations

from ._base import ModelPlan, PlanBuilder, num_experts
from .qwen2_moe import is_sparse

MODEL_TYPE = "qwen3_moe"


def plan(config: dict) -> ModelPlan:
    b = PlanBuilder(MODEL_TYPE, config)
    bias = bool(config.get("attention_bias"))
    e = num_experts(config)
    b.embeddings_and_head()
    for n in range(int(config["num_hidden_layers"])):
        p = f"model.layers.{n}."
        b.layer_norms(p)
        b.gqa_attention(p, q_bias=bias, k_bias=bias, v_bias=bias, o_bias=bias, qk_norm="head")
        if not is_sparse(config, n):
            b.gated_mlp(p + "mlp.", int(config["intermediate_size"]), "dense_mlp")
            continue
        b.add(p + "mlp.gate.weight", (e, b.hidden), "router")
        b.experts(n, p + "mlp.experts")
    return b.build()
