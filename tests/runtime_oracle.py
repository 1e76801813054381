"""Shared runner of the runtime oracle tests, on the real path a user takes:

    tiny transformers checkpoint (tests/tiny_models.py, float32)
      -> colibri-convert (default recipe: attention/dense/expert projections int4_gs64, embeddings and lm_head
         int8_gs64, norms/routers/biases f32) -> a Colibri container
      -> export-hf (dequantized float32 weights) -> transformers: the oracle
      -> colibri-run's model on the memory-mapped container: the system under test

Both sides therefore run the very same quantized weights; only the arithmetic differs.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import tiny_models
import torch


@dataclass
class Pair:
    family: str
    container: Path
    reference: torch.nn.Module


def build_pair(family: str, root: Path, seed: int = 0) -> Pair:
    """Checkpoint, container and exported reference of `family` under root; the oracle loaded in float32."""
    from colibri_convert.convert import convert
    from colibri_convert.export import export_hf
    from colibri_convert.sources import open_source

    checkpoint = tiny_models.save_tiny_checkpoint(family, root / "checkpoint", seed=seed, dtype="f32")
    container = root / "container"
    convert(open_source(str(checkpoint), None), container, None, progress=None)
    exported = export_hf(container, root / "exported")
    return Pair(family, container, tiny_models.load_reference_model(exported))


def reference_logits(model: torch.nn.Module, ids: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model(torch.from_numpy(np.asarray(ids, dtype=np.int64))[None]).logits[0].float().numpy()


def reference_greedy(model: torch.nn.Module, prompt: np.ndarray, n: int) -> list[int]:
    """n greedy tokens from transformers, one full forward per token (no cache, no stop rule)."""
    ids = [int(x) for x in prompt]
    out = []
    for _ in range(n):
        nxt = int(np.argmax(reference_logits(model, np.array(ids))[-1]))
        out.append(nxt)
        ids.append(nxt)
    return out
