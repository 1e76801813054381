"""DeepSeek-V3 (`deepseek_v3`): MLA attention, first_k_dense_replace dense layers, then MoE layers with a router,
a sigmoid-routing correction bias, shared experts and routed experts; MTP layers after the last decoder layer."""

from __future__ import annotations

from ._base import ModelPlan, PlanBuilder, cfg_get

MODEL_TYPE = "deepseek_v3"


def add_mla_moe_model(b: PlanBuilder, *, indexer: bool) -> None:
    c = b.config
    layers = int(c["num_hidden_layers"])
    dense = _dense_layers(c)
    shared = int(c.get("n_shared_experts") or 0) * int(c["moe_intermediate_size"])
    b.embeddings_and_head()
    for n in range(layers + int(c.get("num_nextn_predict_layers") or 0)):
        mtp = n >= layers
        p = f"model.layers.{n}."
        b.layer_norms(p, mtp=mtp)
        b.mla_attention(p, indexer=indexer, mtp=mtp)
        if n in dense and not mtp:
            b.gated_mlp(p + "mlp.", int(c["intermediate_size"]), "dense_mlp")
            continue
        _moe_block(b, n, p, shared, mtp=mtp)
        if mtp:
            b.mtp_head(n)


def _dense_layers(c: dict) -> set[int]:
    kinds = c.get("mlp_layer_types")
    if isinstance(kinds, list):
        return {i for i, k in enumerate(kinds) if k == "dense"}
    return set(range(int(cfg_get(c, "first_k_dense_replace", default=0))))


def _moe_block(b: PlanBuilder, n: int, p: str, shared_inter: int, *, mtp: bool) -> None:
    e = int(cfg_get(b.config, "n_routed_experts"))
    b.add(p + "mlp.gate.weight", (e, b.hidden), "router", mtp=mtp)
    b.add(p + "mlp.gate.e_score_correction_bias", (e,), "bias", mtp=mtp)
    if shared_inter:
        b.gated_mlp(p + "mlp.shared_experts.", shared_inter, "shared_experts", mtp=mtp)
    b.experts(n, p + "mlp.experts", mtp=mtp)


def plan(config: dict) -> ModelPlan:
    b = PlanBuilder(MODEL_TYPE, config)
    add_mla_moe_model(b, indexer=False)
    return b.build()
