"""Opening a model: a container directory (memory-mapped through colibri_format.reader) or in-memory tensors, into a
family's DecoderModel."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from colibri_format.errors import RuntimeModelError
from colibri_format.quant import QuantizedTensor

from .families import get_family
from .model import DecoderModel
from .weights import ContainerExpertProvider, ExpertProvider, MemoryExpertProvider, Weights


def family_of(config: Mapping, declared: str | None = None) -> str:
    model_type = declared or config.get("model_type")
    if not model_type:
        raise RuntimeModelError("config.json has no model_type; cannot tell which family to run")
    return str(model_type)


def build_model(config: Mapping, tensors: Mapping[str, QuantizedTensor], experts: ExpertProvider | Mapping,
                family: str | None = None) -> DecoderModel:
    """A model from in-memory resident tensors (checkpoint names) and routed experts (a provider, or a mapping
    (layer, expert) -> record with .gate/.up/.down)."""
    if not isinstance(experts, (ExpertProvider.__class__,)) and isinstance(experts, Mapping):
        experts = MemoryExpertProvider(experts)
    module = get_family(family_of(config, family))
    return module.build(dict(config), Weights(tensors), experts)


def open_container(path: str | Path):
    from colibri_format.reader import Container

    return Container.open(Path(path))


def load_model(path: str | Path, experts: ExpertProvider | None = None, container=None) -> DecoderModel:
    """Memory-map the container at `path` and build its family's model. Routed experts come through `experts`
    (default: straight from the container's memory map)."""
    c = container if container is not None else open_container(path)
    module = get_family(family_of(c.config, getattr(c, "family", None)))
    provider = experts if experts is not None else ContainerExpertProvider(c)
    model = module.build(dict(c.config), Weights(c), provider)
    model.container = c
    return model
