"""Runtime families: one module per Hugging Face model_type, each exposing MODEL_TYPE and
build(config, weights, experts) -> DecoderModel (see colibri_runtime.model for the plug-in contract)."""

from __future__ import annotations

import importlib
from types import ModuleType

from colibri_format.errors import RuntimeModelError

# model_type -> module name inside this package. Adding a family means adding one module and one line here.
FAMILIES = {
    "olmoe": "olmoe",
    "qwen2_moe": "qwen2_moe",
    "qwen3_moe": "qwen3_moe",
    "mixtral": "mixtral",
    "glm4_moe": "glm4_moe",
    "deepseek_v3": "deepseek_v3",
    "glm_moe_dsa": "glm_moe_dsa",
}


def supported() -> list[str]:
    return sorted(FAMILIES)


def get_family(model_type: str) -> ModuleType:
    """The family module for a model_type; RuntimeModelError naming the supported ones otherwise."""
    name = FAMILIES.get(model_type)
    if name is None:
        raise RuntimeModelError(f"model_type {model_type!r} is not supported by colibri-run; supported: "
                                f"{', '.join(supported())}")
    try:
        return importlib.import_module(f"{__name__}.{name}")
    except ModuleNotFoundError as exc:
        if exc.name == f"{__name__}.{name}":
            raise RuntimeModelError(f"model_type {model_type!r} is registered but its runtime module is not "
                                    "installed") from None
        raise
