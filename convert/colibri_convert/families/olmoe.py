"""OLMoE (`olmoe`): attention with q/k RMS norms over all heads, every layer a MoE block (router + routed experts)."""

from __future__ import annotations

from ._base import ModelPlan, PlanBuilder

MODEL_TYPE = "olmoe"


def plan(config: dict) -> ModelPlan:
    b = PlanBuilder(MODEL_TYPE, config)
    bias = bool(config.get("attention_bias"))
    e = int(config["num_experts"])
    b.embeddings_and_head()
    for n in range(int(config["num_hidden_layers"])):
        p = f"model.layers.{n}."
        b.layer_norms(p)
        b.gqa_attention(p, q_bias=bias, k_bias=bias, v_bias=bias, o_bias=bias, qk_norm="full")
        b.add(p + "mlp.gate.weight", (e, b.hidden), "router")
        b.experts(n, p + "mlp.experts")
    return b.build()
