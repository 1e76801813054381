"""Mixtral (`mixtral`): plain grouped-query attention; every layer a `block_sparse_moe` block whose experts are named
w1 (gate), w3 (up), w2 (down). The fused layout of transformers 5 (`mlp.experts.gate_up_proj`, `mlp.gate`) is accepted
too and stored under the checkpoint names (`block_sparse_moe.*`)."""

from __future__ import annotations

from ._base import ModelPlan, PlanBuilder, num_experts

MODEL_TYPE = "mixtral"


def plan(config: dict) -> ModelPlan:
    b = PlanBuilder(MODEL_TYPE, config)
    e = num_experts(config)
    b.embeddings_and_head()
    for n in range(int(config["num_hidden_layers"])):
        p = f"model.layers.{n}."
        b.layer_norms(p)
        b.gqa_attention(p, q_bias=False, k_bias=False, v_bias=False, o_bias=False, qk_norm=None)
        b.add(p + "block_sparse_moe.gate.weight", (e, b.hidden), "router")
        b.aliases[p + "mlp.gate.weight"] = p + "block_sparse_moe.gate.weight"
        b.experts(n, p + "block_sparse_moe.experts", part_names=("w1", "w3", "w2"), fused_prefix=p + "mlp.experts")
    return b.build()
