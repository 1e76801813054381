"""Shared runner of the runtime oracle tests: a tiny family checkpoint -> a Colibri container -> the runtime, and the
same quantized weights dequantized back into transformers (what `export-hf` produces) as the oracle.

The container is written with colibri_format's ContainerWriter from the checkpoint's tensors quantized with the
default recipe (attention, dense and expert projections int4_gs64; embeddings and lm_head int8_gs64; norms, routers,
biases f32), so the runtime reads real memory-mapped records through colibri_format.reader.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

import tiny_models
from colibri_format.constants import DEFAULT_RECIPE, Encoding
from colibri_format.quant import QuantizedTensor, quantize
from colibri_format.writer import ContainerWriter

EXPERT_NAME = re.compile(
    r"^model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(gate_proj|up_proj|down_proj|w1|w3|w2)\.weight$")
PART = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up", "down_proj": "down", "w2": "down"}
ROUTER = re.compile(r"\.(mlp|block_sparse_moe)\.gate\.(weight|e_score_correction_bias)$|shared_expert_gate\.weight$")


def tensor_class(name: str, t: torch.Tensor) -> str:
    if t.ndim == 1 or name.endswith(".bias") or "norm" in name.rsplit(".", 2)[-2]:
        return "bias" if name.endswith(".bias") else "norm"
    if ROUTER.search(name):
        return "router"
    if "embed_tokens" in name:
        return "embeddings"
    if name.startswith("lm_head"):
        return "lm_head"
    if "shared_expert" in name:
        return "shared_experts"
    if ".self_attn." in name:
        return "attention"
    return "dense_mlp"


def encode(name: str, t: torch.Tensor) -> QuantizedTensor:
    enc = DEFAULT_RECIPE[tensor_class(name, t)]
    arr = t.detach().to(torch.float32).numpy()
    if enc in Encoding.QUANTIZED and arr.ndim != 2:
        enc = Encoding.F32
    return quantize(arr, enc)


@dataclass
class Pair:
    family: str
    container: Path
    reference: torch.nn.Module


def build_pair(family: str, root: Path, seed: int = 0) -> Pair:
    """Write the container and the dequantized reference checkpoint of `family` under root; load the oracle."""
    sd = tiny_models.checkpoint_state_dict(family, seed=seed, layout="per_expert", with_mtp=False)
    config = tiny_models.tiny_config(family).to_dict()
    config["architectures"] = [tiny_models._ARCHITECTURES[family]]
    config.pop("dtype", None)
    out = root / f"{family}.colibri"
    writer = ContainerWriter(out, family=family, config=config, source={"repo": "tiny/" + family},
                             recipe=dict(DEFAULT_RECIPE))
    experts: dict[tuple[int, int], dict[str, QuantizedTensor]] = {}
    dequantized: dict[str, torch.Tensor] = {}
    for name, t in sd.items():
        m = EXPERT_NAME.match(name)
        qt = quantize(t.detach().to(torch.float32).numpy(), Encoding.INT4_GS64) if m else encode(name, t)
        dequantized[name] = torch.from_numpy(np.ascontiguousarray(qt.dequantize()))
        if m:
            experts.setdefault((int(m.group(1)), int(m.group(2))), {})[PART[m.group(3)]] = qt
        else:
            writer.add_tensor(name, qt)
    for (layer, expert), parts in sorted(experts.items()):
        writer.add_expert(layer, expert, gate=parts["gate"], up=parts["up"], down=parts["down"])
    tok_dir = root / f"{family}.tok"
    tok_dir.mkdir(exist_ok=True)
    tiny_models.build_tokenizer().save(str(tok_dir / "tokenizer.json"))
    writer.add_verbatim_file("tokenizer.json", (tok_dir / "tokenizer.json").read_bytes())
    writer.add_verbatim_file("tokenizer_config.json", json.dumps(tiny_models.tokenizer_config()).encode())
    writer.add_verbatim_file("generation_config.json", json.dumps({"eos_token_id": 257, "bos_token_id": 256}).encode())
    writer.finish()
    ref_dir = root / f"{family}.hf"
    ref_dir.mkdir()
    tiny_models.save_state_dict(dequantized, ref_dir)
    (ref_dir / "config.json").write_text(json.dumps(config))
    return Pair(family, out, tiny_models.load_reference_model(ref_dir))


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
