"""GLM-5 (`glm_moe_dsa`): DeepSeek-V3's MLA + MoE layout plus the DSA lightning indexer in every attention block
(`self_attn.indexer.{wq_b,wk,k_norm,weights_proj}`), and MTP layers kept int8 in their own files."""

from __future__ import annotations

from ._base import ModelPlan, PlanBuilder
from .deepseek_v3 import add_mla_moe_model

MODEL_TYPE = "glm_moe_dsa"


def plan(config: dict) -> ModelPlan:
    b = PlanBuilder(MODEL_TYPE, config)
    add_mla_moe_model(b, indexer=True)
    return b.build()
