"""GLM-4.5 (`glm4_moe`): grouped-query attention (q/k/v biases when attention_bias, optional per-head q/k norms),
dense first layers, then MoE layers with router, correction bias, shared and routed experts; MTP layers at the end."""

from __future__ import annotations

from ._base import ModelPlan, PlanBuilder, cfg_get

MODEL_TYPE = "glm4_moe"


def plan(config: dict) -> ModelPlan:
    b = PlanBuilder(MODEL_TYPE, config)
    c = config
    layers = int(c["num_hidden_layers"])
    dense = int(cfg_get(c, "first_k_dense_replace", default=0))
    shared = int(c.get("n_shared_experts") or 0) * int(c["moe_intermediate_size"])
    e = int(c["n_routed_experts"])
    bias = bool(c.get("attention_bias"))
    b.embeddings_and_head()
    for n in range(layers + int(c.get("num_nextn_predict_layers") or 0)):
        mtp = n >= layers
        p = f"model.layers.{n}."
        b.layer_norms(p, mtp=mtp)
        b.gqa_attention(p, q_bias=bias, k_bias=bias, v_bias=bias, o_bias=False,
                        qk_norm="head" if c.get("use_qk_norm") else None, mtp=mtp)
        if n < dense and not mtp:
            b.gated_mlp(p + "mlp.", int(c["intermediate_size"]), "dense_mlp")
            continue
        b.add(p + "mlp.gate.weight", (e, b.hidden), "router", mtp=mtp)
        b.add(p + "mlp.gate.e_score_correction_bias", (e,), "bias", mtp=mtp)
        if shared:
            b.gated_mlp(p + "mlp.shared_experts.", shared, "shared_experts", mtp=mtp)
        b.experts(n, p + "mlp.experts", mtp=mtp)
        if mtp:
            b.mtp_head(n)
    return b.build()
