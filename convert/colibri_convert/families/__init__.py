"""Converter families: one module per Hugging Face model_type, each with `MODEL_TYPE` and `plan(config)`."""

from __future__ import annotations

import importlib

from colibri_format.errors import ConversionError

from ._base import ModelPlan

SUPPORTED = ("deepseek_v3", "glm4_moe", "glm_moe_dsa", "mixtral", "olmoe", "qwen2_moe", "qwen3_moe")


def plan_for(config: dict) -> ModelPlan:
    """The conversion plan of a checkpoint from its config.json; unknown model types are refused."""
    model_type = config.get("model_type")
    if model_type not in SUPPORTED:
        raise ConversionError(
            f"model_type {model_type!r} is not supported; supported model types: {', '.join(SUPPORTED)}"
        )
    module = importlib.import_module(f"{__name__}.{model_type}")
    try:
        return module.plan(config)
    except (KeyError, TypeError, ValueError) as exc:
        raise ConversionError(f"config.json of this {model_type} checkpoint is incomplete or malformed ({exc!r})") from None


__all__ = ["SUPPORTED", "ModelPlan", "plan_for"]
