"""Tiny containers for the colibri-inspect tests, written directly with ContainerWriter (no transformers needed),
and the surgery that turns a sound one into each kind of broken one."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np

from colibri_format.quant import QuantizedTensor, quantize_reference
from colibri_format.usage import UsageCounts
from colibri_format.writer import ContainerWriter, IndexEntry, model_fingerprint, write_index

HIDDEN, INTER, VOCAB, LAYERS, EXPERTS, TOP_K = 64, 32, 96, 3, 4, 2
CONFIG = {
    "model_type": "qwen3_moe",
    "num_hidden_layers": LAYERS,
    "hidden_size": HIDDEN,
    "vocab_size": VOCAB,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "moe_intermediate_size": INTER,
    "intermediate_size": 96,
    "num_experts": EXPERTS,
    "num_experts_per_tok": TOP_K,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "max_position_embeddings": 256,
}


def build_container(
    out: Path,
    *,
    seed: int = 0,
    shard_bytes: int = 40_000,
    nan_tensor: str | None = None,
    nan_expert: tuple[int, int] | None = None,
    with_tokenizer: bool = True,
) -> Path:
    """A qwen3_moe-shaped container: 3 MoE layers x 4 experts, several expert data files."""
    rng = np.random.default_rng(seed)

    def q(shape, enc="int4_gs64"):
        return quantize_reference(rng.standard_normal(shape).astype(np.float32), enc)

    w = ContainerWriter(
        out,
        family="qwen3_moe",
        config=CONFIG,
        source={"repo": "tiny/qwen3-moe", "revision": "abc123", "files": {"model.safetensors": "0" * 64}},
        recipe={"routed_experts": "int4_gs64", "attention": "int4_gs64", "embeddings": "int8_gs64", "norm": "f32"},
        shard_bytes=shard_bytes,
    )
    if with_tokenizer:
        w.add_verbatim_file("tokenizer.json", _tokenizer_json())
    w.add_tensor("model.embed_tokens.weight", q((VOCAB, HIDDEN), "int8_gs64"))
    w.add_tensor("lm_head.weight", q((VOCAB, HIDDEN), "int8_gs64"))
    w.add_tensor("model.norm.weight", q((HIDDEN,), "f32"))
    for layer in range(LAYERS):
        p = f"model.layers.{layer}."
        w.add_tensor(p + "input_layernorm.weight", q((HIDDEN,), "f32"))
        w.add_tensor(p + "post_attention_layernorm.weight", q((HIDDEN,), "f32"))
        w.add_tensor(p + "self_attn.q_proj.weight", q((64, HIDDEN)))
        w.add_tensor(p + "mlp.gate.weight", q((EXPERTS, HIDDEN), "f32"))
        for e in range(EXPERTS):
            gate, up, down = q((INTER, HIDDEN)), q((INTER, HIDDEN)), q((HIDDEN, INTER))
            if nan_expert == (layer, e):
                scales = up.scales.copy()
                scales[0, 0] = np.float16(np.nan)
                up = QuantizedTensor(up.encoding, up.shape, up.data, scales)
            w.add_expert(layer, e, gate=gate, up=up, down=down)
    if nan_tensor is not None:
        t = q((64, HIDDEN))
        scales = t.scales.copy()
        scales[1, 0] = np.float16(np.inf)
        w.add_tensor(nan_tensor, QuantizedTensor(t.encoding, t.shape, t.data, scales))
    return w.finish()


def _tokenizer_json() -> bytes:
    from tokenizers import Tokenizer, models

    vocab = {f"t{i}": i for i in range(VOCAB - 4)}
    vocab["[UNK]"] = VOCAB - 4
    return Tokenizer(models.WordLevel(vocab, unk_token="[UNK]")).to_str().encode()


def write_usage(container: Path, counts: np.ndarray, turns: int = 5) -> Path:
    """A .coli_usage sidecar for `container` with these counts (rows = every decoder layer)."""
    manifest = json.loads((container / "colibri.json").read_text())
    u = UsageCounts(manifest["fingerprint"], np.asarray(counts, dtype=np.float32), turns=turns)
    path = container / ".coli_usage"
    u.save(path)
    return path


# --- surgery ------------------------------------------------------------------------------------------------------


def manifest(container: Path) -> dict:
    return json.loads((container / "colibri.json").read_text())


def write_manifest(container: Path, m: dict, refingerprint: bool = True) -> None:
    if refingerprint:
        m["fingerprint"] = model_fingerprint(m["files"])
    (container / "colibri.json").write_text(json.dumps(m, indent=2, sort_keys=True) + "\n")


def index_entries(container: Path) -> list[IndexEntry]:
    import pyarrow as pa

    t = pa.ipc.open_file(pa.memory_map(str(container / "experts.arrow"))).read_all().to_pylist()
    return [
        IndexEntry(r["layer"], r["expert"], r["file"], r["offset"], r["length"], r["crc32"],
                   (r["gate_encoding"], r["up_encoding"], r["down_encoding"]))
        for r in t
    ]


def rewrite_index(container: Path, entries: list[IndexEntry]) -> None:
    """Replace the index and keep the manifest consistent with it (only the index lies)."""
    info = write_index(container / "experts.arrow", entries)
    m = manifest(container)
    m["files"]["experts.arrow"].update(size=info.size, sha256=info.sha256)
    m["experts"]["records"] = len(entries)
    write_manifest(container, m)


def set_file_entry(container: Path, name: str, data: bytes | None = None) -> None:
    """Rewrite a file's manifest entry from its bytes on disk (or `data`)."""
    p = container / name
    raw = p.read_bytes() if data is None else data
    m = manifest(container)
    m["files"][name].update(size=len(raw), sha256=hashlib.sha256(raw).hexdigest())
    write_manifest(container, m)
