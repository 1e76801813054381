"""Write a real-dimension Hugging Face checkpoint with random bf16 weights, without building the model in torch.

The checkpoint has the exact tensor names and shapes of the published model (per-expert keys, as on the Hub), sharded
bf16 safetensors files with model.safetensors.index.json, config.json, generation_config.json and a small byte-level
BPE tokenizer. Conversion and streaming speed depend on shapes, not on weight values, so random weights are enough.

Shapes:
- `olmoe`: OLMoE-1B-7B (hidden 2048, 64 experts of width 1024, top-8, vocab 50304, 16 heads, q/k norms over all
  heads). `--layers` defaults to 8 of its 16 layers (about 7 GB in bf16).
- `deepseek_v3`: DeepSeek-V3's structure scaled down so a few layers fit a small disk: hidden 2048 (7168 in the
  original), 16 heads (128), 64 routed experts (256) of width 512 (2048) plus one shared expert, top-8 in 8 groups
  choosing 4, the first layer dense (intermediate 4096); the MLA dimensions are DeepSeek-V3's own (q_lora_rank 1536,
  kv_lora_rank 512, qk_nope_head_dim 128, qk_rope_head_dim 64, v_head_dim 128), vocab 129280. No MTP layer (as
  transformers' save_pretrained writes it).

Values: norms are 1; every other tensor is drawn from N(0, 0.02) rounded to bf16. To be fast on a small machine the
normal values are generated once into a pool of 2^24 numbers, and each tensor is a cyclic run of that pool starting at
an offset drawn from a generator seeded by (--seed, tensor name): deterministic, and every tensor different. Shards
are written tensor by tensor, so memory stays at the size of the pool whatever the model size.

    python bench/make_random_checkpoint.py [--family olmoe] [--layers 8] [--shard-gb 3] [--out DIR] [--check]

`--check` loads the written checkpoint with transformers (only sensible for a 1-layer one) and fails on any missing
or unexpected key.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import struct
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = Path("/work/benchdata")
POOL_BITS = 24
STD = 0.02

# --- model configs ------------------------------------------------------------------------------------------------


def olmoe_config(layers: int) -> dict:
    return {
        "architectures": ["OlmoeForCausalLM"], "model_type": "olmoe", "attention_bias": False,
        "attention_dropout": 0.0, "clip_qkv": None, "hidden_act": "silu", "hidden_size": 2048,
        "initializer_range": 0.02, "intermediate_size": 1024, "max_position_embeddings": 4096,
        "norm_topk_prob": False, "num_attention_heads": 16, "num_experts": 64, "num_experts_per_tok": 8,
        "num_hidden_layers": layers, "num_key_value_heads": 16, "output_router_logits": False,
        "rms_norm_eps": 1e-05, "rope_scaling": None, "rope_theta": 10000.0, "router_aux_loss_coef": 0.01,
        "tie_word_embeddings": False, "torch_dtype": "bfloat16", "vocab_size": 50304,
        "bos_token_id": 256, "eos_token_id": 257, "pad_token_id": 258,
    }


def deepseek_v3_config(layers: int) -> dict:
    return {
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "attention_bias": False,
        "attention_dropout": 0.0, "first_k_dense_replace": 1, "hidden_act": "silu", "hidden_size": 2048,
        "initializer_range": 0.02, "intermediate_size": 4096, "kv_lora_rank": 512, "max_position_embeddings": 4096,
        "moe_intermediate_size": 512, "n_group": 8, "n_routed_experts": 64, "n_shared_experts": 1,
        "norm_topk_prob": True, "num_attention_heads": 16, "num_experts_per_tok": 8, "num_hidden_layers": layers,
        "num_key_value_heads": 16, "num_nextn_predict_layers": 0, "q_lora_rank": 1536, "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64, "head_dim": 64, "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 10000.0,
        "routed_scaling_factor": 2.5, "scoring_func": "sigmoid", "tie_word_embeddings": False, "topk_group": 4,
        "topk_method": "noaux_tc", "torch_dtype": "bfloat16", "v_head_dim": 128, "vocab_size": 129280,
        "bos_token_id": 256, "eos_token_id": 257, "pad_token_id": 258,
    }


# --- tensor lists (model order: embeddings, layers, final norm, head) ---------------------------------------------


def olmoe_tensors(c: dict) -> list[tuple[str, tuple[int, ...], str]]:
    h, inter, e, v = c["hidden_size"], c["intermediate_size"], c["num_experts"], c["vocab_size"]
    kv = c["num_key_value_heads"] * (h // c["num_attention_heads"])
    out = [("model.embed_tokens.weight", (v, h), "normal")]
    for n in range(c["num_hidden_layers"]):
        p = f"model.layers.{n}."
        out += [(p + "input_layernorm.weight", (h,), "ones"), (p + "post_attention_layernorm.weight", (h,), "ones"),
                (p + "self_attn.q_proj.weight", (h, h), "normal"), (p + "self_attn.k_proj.weight", (kv, h), "normal"),
                (p + "self_attn.v_proj.weight", (kv, h), "normal"), (p + "self_attn.o_proj.weight", (h, h), "normal"),
                (p + "self_attn.q_norm.weight", (h,), "ones"), (p + "self_attn.k_norm.weight", (kv,), "ones"),
                (p + "mlp.gate.weight", (e, h), "normal")]
        for x in range(e):
            q = f"{p}mlp.experts.{x}."
            out += [(q + "gate_proj.weight", (inter, h), "normal"), (q + "up_proj.weight", (inter, h), "normal"),
                    (q + "down_proj.weight", (h, inter), "normal")]
    return out + [("model.norm.weight", (h,), "ones"), ("lm_head.weight", (v, h), "normal")]


def deepseek_v3_tensors(c: dict) -> list[tuple[str, tuple[int, ...], str]]:
    h, v, heads = c["hidden_size"], c["vocab_size"], c["num_attention_heads"]
    ql, kvl, nope, rope, vd = (c["q_lora_rank"], c["kv_lora_rank"], c["qk_nope_head_dim"], c["qk_rope_head_dim"],
                               c["v_head_dim"])
    inter, moe, e = c["intermediate_size"], c["moe_intermediate_size"], c["n_routed_experts"]

    def mlp(p: str, width: int) -> list:
        return [(p + "gate_proj.weight", (width, h), "normal"), (p + "up_proj.weight", (width, h), "normal"),
                (p + "down_proj.weight", (h, width), "normal")]

    out = [("model.embed_tokens.weight", (v, h), "normal")]
    for n in range(c["num_hidden_layers"]):
        p = f"model.layers.{n}."
        a = p + "self_attn."
        out += [(p + "input_layernorm.weight", (h,), "ones"), (p + "post_attention_layernorm.weight", (h,), "ones"),
                (a + "q_a_proj.weight", (ql, h), "normal"), (a + "q_a_layernorm.weight", (ql,), "ones"),
                (a + "q_b_proj.weight", (heads * (nope + rope), ql), "normal"),
                (a + "kv_a_proj_with_mqa.weight", (kvl + rope, h), "normal"),
                (a + "kv_a_layernorm.weight", (kvl,), "ones"),
                (a + "kv_b_proj.weight", (heads * (nope + vd), kvl), "normal"),
                (a + "o_proj.weight", (h, heads * vd), "normal")]
        if n < c["first_k_dense_replace"]:
            out += mlp(p + "mlp.", inter)
            continue
        out += [(p + "mlp.gate.weight", (e, h), "normal"), (p + "mlp.gate.e_score_correction_bias", (e,), "bias")]
        for x in range(e):
            out += mlp(f"{p}mlp.experts.{x}.", moe)
        out += mlp(p + "mlp.shared_experts.", moe * c["n_shared_experts"])
    return out + [("model.norm.weight", (h,), "ones"), ("lm_head.weight", (v, h), "normal")]


FAMILIES = {"olmoe": (olmoe_config, olmoe_tensors), "deepseek_v3": (deepseek_v3_config, deepseek_v3_tensors)}

# --- values -------------------------------------------------------------------------------------------------------


def normal_pool(seed: int) -> np.ndarray:
    """2^POOL_BITS bf16 bit patterns of N(0, STD) values (round to nearest even)."""
    x = np.random.default_rng(seed).standard_normal(1 << POOL_BITS, dtype=np.float32) * np.float32(STD)
    bits = x.view(np.uint32)
    return ((bits + ((bits >> 16) & 1) + np.uint32(0x7FFF)) >> 16).astype(np.uint16)


def tensor_seed(seed: int, name: str) -> int:
    return int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:8], "little")


def write_values(f, pool: np.ndarray, name: str, count: int, kind: str, seed: int) -> None:
    """Write `count` bf16 values of one tensor to file object `f`."""
    if kind == "ones":
        f.write(np.full(count, 0x3F80, dtype=np.uint16).tobytes())
        return
    if kind == "bias":  # small positive routing correction biases
        rng = np.random.default_rng(tensor_seed(seed, name))
        x = (rng.random(count, dtype=np.float32) * np.float32(0.1)).view(np.uint32)
        f.write((x >> 16).astype(np.uint16).tobytes())
        return
    start = int(np.random.default_rng(tensor_seed(seed, name)).integers(pool.size))
    remaining = count
    while remaining:
        n = min(remaining, pool.size - start)
        f.write(memoryview(pool[start:start + n]).cast("B"))
        remaining -= n
        start = 0


# --- shards -------------------------------------------------------------------------------------------------------


def split_shards(tensors: list, shard_bytes: int) -> list[list]:
    """Contiguous runs of tensors (model order) of about equal size, none above `shard_bytes` unless one tensor is."""
    total = sum(2 * math.prod(s) for _, s, _ in tensors)
    count = max(1, math.ceil(total / shard_bytes))
    target = total / count
    shards, current, size = [], [], 0
    for t in tensors:
        nbytes = 2 * math.prod(t[1])
        if current and size + nbytes > target * 1.02 and len(shards) < count - 1:
            shards.append(current)
            current, size = [], 0
        current.append(t)
        size += nbytes
    return shards + [current]


def write_shard(path: Path, tensors: list, pool: np.ndarray, seed: int) -> int:
    """One bf16 safetensors file, tensors in name order as the safetensors package writes them."""
    items = sorted(tensors)
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape, _ in items:
        nbytes = 2 * math.prod(shape)
        header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    tmp = path.with_name(path.name + ".partial")
    with open(tmp, "wb", buffering=16 * 1024 * 1024) as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        for name, shape, kind in items:
            write_values(f, pool, name, math.prod(shape), kind, seed)
    os.replace(tmp, path)
    return offset


def write_tokenizer(out: Path) -> None:
    sys.path.insert(0, str(ROOT / "tests"))
    from tiny_models import build_tokenizer, tokenizer_config

    build_tokenizer().save(str(out / "tokenizer.json"))
    cfg = dict(tokenizer_config(), model_max_length=4096)
    (out / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def make_checkpoint(family: str, layers: int, out: Path, shard_gb: float, seed: int) -> dict:
    make_config, make_tensors = FAMILIES[family]
    config = make_config(layers)
    tensors = make_tensors(config)
    out.mkdir(parents=True, exist_ok=True)
    pool = normal_pool(seed)
    shards = split_shards(tensors, int(shard_gb * 1e9))
    weight_map, total = {}, 0
    for i, group in enumerate(shards, start=1):
        fname = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        t = time.perf_counter()
        nbytes = write_shard(out / fname, group, pool, seed)
        print(f"  {fname}: {len(group)} tensors, {nbytes / 1e9:.2f} GB in {time.perf_counter() - t:.1f} s")
        total += nbytes
        weight_map.update({name: fname for name, _, _ in group})
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    gen = {"bos_token_id": 256, "eos_token_id": 257, "pad_token_id": 258}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2, sort_keys=True) + "\n")
    write_tokenizer(out)
    return {"path": str(out), "family": family, "layers": layers, "shards": len(shards), "bytes": total,
            "tensors": len(tensors)}


def check_loads(out: Path) -> None:
    """Load the checkpoint with transformers; fail on missing, unexpected or mismatched keys."""
    import torch
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.bfloat16, output_loading_info=True)
    problems = {k: v for k, v in info.items() if v}
    if problems:
        raise SystemExit(f"transformers reports {problems}")
    n = sum(p.numel() for p in model.parameters())
    print(f"  transformers loads it: {type(model).__name__}, {n / 1e9:.3f} B parameters, no missing/unexpected keys")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--family", choices=sorted(FAMILIES), default="olmoe")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--shard-gb", type=float, default=3.0, help="largest shard size in GB (default 3)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, help="output folder (default /work/benchdata/<family>-random-<N>l)")
    ap.add_argument("--check", action="store_true", help="load it back with transformers (small models only)")
    args = ap.parse_args(argv)
    out = args.out or DEFAULT_OUT / f"{args.family}-random-{args.layers}l"
    t = time.perf_counter()
    info = make_checkpoint(args.family, args.layers, out, args.shard_gb, args.seed)
    print(f"{info['path']}: {info['tensors']} tensors, {info['bytes'] / 1e9:.2f} GB in {info['shards']} shard(s), "
          f"{time.perf_counter() - t:.1f} s")
    if args.check:
        check_loads(out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
