"""export-hf: write a container back as a Hugging Face checkpoint with dequantized weights.

Every resident and MTP tensor is written under its checkpoint name, and every expert record as per-expert tensors
under the family's checkpoint names (`{prefix}.{e}.gate_proj.weight`, mixtral `w1/w3/w2`), which transformers loads
into its fused modules. config.json and the tokenizer files are copied verbatim; the FP8 quantization_config of a
source checkpoint is dropped because the weights written are plain floats. Shards of at most `shard_bytes`.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from colibri_format.constants import VERBATIM_FILES
from colibri_format.errors import ConversionError
from colibri_format.reader import Container
from colibri_format.safetensors_io import write_arrays

from .families import plan_for

DTYPES = {"f32": ("F32", np.float32), "f16": ("F16", np.float16)}


def _bf16(x: np.ndarray) -> np.ndarray:
    from colibri_format.quant import f32_to_bf16_bits

    return f32_to_bf16_bits(x)


def export_hf(container_dir: Path, out_dir: Path, *, dtype: str = "f32", shard_bytes: int = 2 * 1024**3) -> Path:
    """Write the Hugging Face checkpoint of a container into out_dir (created; must be empty if it exists)."""
    out = Path(out_dir)
    if out.exists() and any(out.iterdir()):
        raise ConversionError(f"{out} exists and is not empty; choose a new directory for export-hf")
    if dtype not in ("f32", "f16", "bf16"):
        raise ConversionError(f"export dtype must be f32, f16 or bf16, not {dtype!r}")
    out.mkdir(parents=True, exist_ok=True)
    with Container.open(container_dir) as c:
        plan = plan_for(c.config)
        weight_map: dict[str, str] = {}
        shards: list[list[tuple[str, str, np.ndarray]]] = [[]]
        size = [0]

        def add(name: str, value: np.ndarray) -> None:
            if dtype == "bf16":
                item = (name, "BF16", _bf16(value))
            else:
                st, npd = DTYPES[dtype]
                item = (name, st, value.astype(npd))
            if shards[-1] and size[0] + item[2].nbytes > shard_bytes:
                shards.append([])
                size[0] = 0
            shards[-1].append(item)
            size[0] += item[2].nbytes

        for name in sorted(c.tensor_names()):
            add(name, c.tensor(name).dequantize())
        for layer in c.expert_layers:
            el = plan.expert_layers.get(layer)
            if el is None:
                raise ConversionError(f"container has experts for layer {layer}, which {plan.family} does not expect")
            for x in range(c.num_experts):
                rec = c.expert(layer, x)
                for part, qt in (("gate", rec.gate), ("up", rec.up), ("down", rec.down)):
                    add(f"{el.prefix}.{x}.{el.part_names[('gate', 'up', 'down').index(part)]}.weight",
                        qt.dequantize())
        names = []
        for i, items in enumerate(shards, start=1):
            fname = "model.safetensors" if len(shards) == 1 else f"model-{i:05d}-of-{len(shards):05d}.safetensors"
            write_arrays(out / fname, items, {"format": "pt"})
            names.append(fname)
            for n, _, _ in items:
                weight_map[n] = fname
        if len(shards) > 1:
            total = sum(a.nbytes for items in shards for _, _, a in items)
            (out / "model.safetensors.index.json").write_text(
                json.dumps({"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))},
                           indent=2))
        config = dict(c.config)
        config.pop("quantization_config", None)
        config["torch_dtype"] = {"f32": "float32", "f16": "float16", "bf16": "bfloat16"}[dtype]
        (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        for name in VERBATIM_FILES:
            if name != "config.json" and (c.path / name).is_file():
                (out / name).write_bytes((c.path / name).read_bytes())
    return out
