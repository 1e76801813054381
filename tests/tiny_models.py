"""Tiny random Hugging Face MoE checkpoints, one per supported family, for converter and runtime tests.

Every model is built by transformers from a small config with a fixed torch seed, so the same (family, seed) always
gives the same weights. `save_tiny_checkpoint` writes what a Hub repository would hold: config.json, safetensors
shards (one file, or several plus model.safetensors.index.json), a small byte-level BPE tokenizer built in code and
its tokenizer_config.json.

Choices a test may rely on:
- Routing correction biases (`e_score_correction_bias`) are randomised; transformers initialises them to zero.
- `olmoe` has input widths that are not multiples of 64 (hidden 96, expert width 80).
- `deepseek_v3`, `glm4_moe` and `glm_moe_dsa` declare `num_nextn_predict_layers: 1` and the saved checkpoint carries
  that MTP layer under the official DeepSeek-V3/GLM-5 names `model.layers.{num_hidden_layers}.*`: `enorm`, `hnorm`,
  `eh_proj` [H, 2H], `shared_head.norm`, `shared_head.head` [V, H] and a full MoE decoder layer (attention, router,
  correction bias, shared experts, routed experts, both layer norms). transformers ignores these keys on load.
- `glm_moe_dsa` uses `index_topk = 8`, below the sequence lengths tests use (32+), so the DSA indexer really selects.
- layout "per_expert" writes `...experts.{e}.gate_proj.weight` (mixtral: `block_sparse_moe.experts.{e}.w1.weight`),
  the names `save_pretrained` writes; layout "fused" writes transformers' in-memory names, with 3D
  `mlp.experts.gate_up_proj` [E, 2*I, H] (gate rows first) and `mlp.experts.down_proj` [E, H, I].
- dtype "fp8" stores every 2D projection weight except embeddings, lm_head and routers as float8 e4m3 with float32
  128x128 block scales `{name}_scale_inv` (the DeepSeek-V3 format). Block scales are powers of two, so the values the
  FP8 checkpoint represents are exactly representable in bf16: `fp8_reference_state_dict` returns them.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
import transformers
from transformers import AutoModelForCausalLM

FAMILIES = ("olmoe", "qwen2_moe", "qwen3_moe", "mixtral", "deepseek_v3", "glm4_moe", "glm_moe_dsa")
MTP_FAMILIES = ("deepseek_v3", "glm4_moe", "glm_moe_dsa")
VOCAB_SIZE = 320
FP8_BLOCK = 128
FP8_E4M3_MAX = 448.0

_COMMON = dict(vocab_size=VOCAB_SIZE, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
               max_position_embeddings=512, bos_token_id=256, eos_token_id=257, pad_token_id=258,
               tie_word_embeddings=False)


def _mla(**over) -> dict:
    # transformers' MLA needs head_dim == qk_rope_head_dim.
    base = dict(num_key_value_heads=_COMMON["num_attention_heads"], q_lora_rank=32, kv_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=16, head_dim=16)
    base.update(over)
    return base


def tiny_config(family: str) -> transformers.PretrainedConfig:
    """The tiny config of one family."""
    if family == "olmoe":
        c = dict(_COMMON, hidden_size=96, intermediate_size=80, num_hidden_layers=2, num_experts=4,
                 num_experts_per_tok=2)
        return transformers.OlmoeConfig(**c)
    if family == "qwen2_moe":
        return transformers.Qwen2MoeConfig(**_COMMON, num_hidden_layers=2, intermediate_size=96,
                                           moe_intermediate_size=32, shared_expert_intermediate_size=48,
                                           num_experts=4, num_experts_per_tok=2)
    if family == "qwen3_moe":
        return transformers.Qwen3MoeConfig(**_COMMON, num_hidden_layers=2, intermediate_size=96,
                                           moe_intermediate_size=32, num_experts=6, num_experts_per_tok=2,
                                           head_dim=16, norm_topk_prob=True)
    if family == "mixtral":
        return transformers.MixtralConfig(**_COMMON, num_hidden_layers=2, intermediate_size=64, num_local_experts=4,
                                          num_experts_per_tok=2)
    if family == "deepseek_v3":
        return transformers.DeepseekV3Config(**{**_COMMON, **_mla()}, num_hidden_layers=3, intermediate_size=96,
                                             moe_intermediate_size=32, n_routed_experts=8, n_shared_experts=1,
                                             n_group=4, topk_group=2, num_experts_per_tok=2, first_k_dense_replace=1,
                                             num_nextn_predict_layers=1, routed_scaling_factor=2.5)
    if family == "glm4_moe":
        return transformers.Glm4MoeConfig(**_COMMON, num_hidden_layers=3, intermediate_size=96,
                                          moe_intermediate_size=32, n_routed_experts=8, n_shared_experts=1,
                                          n_group=1, topk_group=1, num_experts_per_tok=2, first_k_dense_replace=1,
                                          head_dim=16, num_nextn_predict_layers=1, routed_scaling_factor=2.5,
                                          use_qk_norm=True)
    if family == "glm_moe_dsa":
        return transformers.GlmMoeDsaConfig(**{**_COMMON, **_mla()}, num_hidden_layers=3, intermediate_size=96,
                                            moe_intermediate_size=32, n_routed_experts=8, n_shared_experts=1,
                                            n_group=1, topk_group=1, num_experts_per_tok=2, first_k_dense_replace=1,
                                            index_topk=8, index_head_dim=32, index_n_heads=2,
                                            num_nextn_predict_layers=1, routed_scaling_factor=2.5)
    raise ValueError(f"no tiny model for family {family!r}; known: {', '.join(FAMILIES)}")


def _randomise_biases(model: torch.nn.Module, gen: torch.Generator) -> None:
    for name, buf in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            buf.copy_(torch.randn(buf.shape, generator=gen) * 0.1)


def build_tiny_model(family: str, seed: int = 0) -> torch.nn.Module:
    """A tiny float32 model in eval mode with random weights (fixed seed) and randomised correction biases."""
    torch.manual_seed(seed)
    with torch.no_grad():
        model = AutoModelForCausalLM.from_config(tiny_config(family), dtype=torch.float32)
        _randomise_biases(model, torch.Generator().manual_seed(seed + 1))
    return model.eval()


# --- checkpoint state dicts ---------------------------------------------------------------------------------------


def _per_expert_names(family: str, sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Split fused 3D expert tensors into the per-expert names save_pretrained writes."""
    out: dict[str, torch.Tensor] = {}
    for name, t in sd.items():
        if name.endswith(".experts.gate_up_proj"):
            prefix = name[: -len("gate_up_proj")]
            inter = t.shape[1] // 2
            for e in range(t.shape[0]):
                out[f"{prefix}{e}.gate_proj.weight"] = t[e, :inter].clone()
                out[f"{prefix}{e}.up_proj.weight"] = t[e, inter:].clone()
        elif name.endswith(".experts.down_proj"):
            prefix = name[: -len("down_proj")]
            for e in range(t.shape[0]):
                out[f"{prefix}{e}.down_proj.weight"] = t[e].clone()
        else:
            out[name] = t
    if family == "mixtral":
        renamed = {}
        for name, t in out.items():
            name = name.replace(".mlp.", ".block_sparse_moe.")
            name = name.replace(".gate_proj.weight", ".w1.weight").replace(".down_proj.weight", ".w2.weight")
            renamed[name.replace(".up_proj.weight", ".w3.weight")] = t
        out = renamed
    return out


def _mtp_state_dict(family: str, seed: int) -> dict[str, torch.Tensor]:
    """The MTP layer of a DeepSeek-V3/GLM-5 style checkpoint, fused layout, under `model.layers.{N}.*`."""
    cfg = tiny_config(family)
    n = cfg.num_hidden_layers
    donor_cfg = tiny_config(family)
    donor_cfg.num_hidden_layers = n + 1
    for key in ("mlp_layer_types", "layer_types", "indexer_types"):
        seq = getattr(donor_cfg, key, None)
        if isinstance(seq, list):
            setattr(donor_cfg, key, seq + seq[-1:])
    torch.manual_seed(seed + 7)
    with torch.no_grad():
        donor = AutoModelForCausalLM.from_config(donor_cfg, dtype=torch.float32)
        _randomise_biases(donor, torch.Generator().manual_seed(seed + 8))
    prefix = f"model.layers.{n}."
    out = {k: v.detach().clone() for k, v in donor.state_dict().items() if k.startswith(prefix)}
    gen = torch.Generator().manual_seed(seed + 9)
    h, v = cfg.hidden_size, cfg.vocab_size
    out[prefix + "enorm.weight"] = 1.0 + 0.1 * torch.randn(h, generator=gen)
    out[prefix + "hnorm.weight"] = 1.0 + 0.1 * torch.randn(h, generator=gen)
    out[prefix + "eh_proj.weight"] = 0.02 * torch.randn(h, 2 * h, generator=gen)
    out[prefix + "shared_head.norm.weight"] = 1.0 + 0.1 * torch.randn(h, generator=gen)
    out[prefix + "shared_head.head.weight"] = 0.02 * torch.randn(v, h, generator=gen)
    return out


def checkpoint_state_dict(family: str, *, seed: int = 0, layout: str = "per_expert",
                          with_mtp: bool | None = None) -> dict[str, torch.Tensor]:
    """Every tensor of the float32 checkpoint, under the names it is saved with."""
    if layout not in ("per_expert", "fused"):
        raise ValueError(f"layout must be 'per_expert' or 'fused', not {layout!r}")
    model = build_tiny_model(family, seed)
    sd = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
    if with_mtp is None:
        with_mtp = family in MTP_FAMILIES
    if with_mtp:
        sd.update(_mtp_state_dict(family, seed))
    if layout == "per_expert":
        sd = _per_expert_names(family, sd)
    return sd


# --- FP8 e4m3 with 128x128 block scales (DeepSeek-V3) -------------------------------------------------------------


def _fp8_eligible(name: str, t: torch.Tensor) -> bool:
    if t.ndim not in (2, 3) or not name.endswith(("weight", "_proj")):
        return False
    excluded = ("embed_tokens", "lm_head", "shared_head.head", "mlp.gate.weight", "shared_expert_gate", "norm")
    return not any(x in name for x in excluded)


def _fp8_quantize_2d(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    rows, cols = w.shape
    br, bc = math.ceil(rows / FP8_BLOCK), math.ceil(cols / FP8_BLOCK)
    scale_inv = torch.empty(br, bc, dtype=torch.float32)
    q = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
    for i in range(br):
        for j in range(bc):
            block = w[i * FP8_BLOCK:(i + 1) * FP8_BLOCK, j * FP8_BLOCK:(j + 1) * FP8_BLOCK].float()
            amax = float(block.abs().max())
            s = 2.0 ** math.ceil(math.log2(amax / FP8_E4M3_MAX)) if amax > 0 else 1.0
            scale_inv[i, j] = s
            q[i * FP8_BLOCK:(i + 1) * FP8_BLOCK, j * FP8_BLOCK:(j + 1) * FP8_BLOCK] = (block / s).to(
                torch.float8_e4m3fn)
    return q, scale_inv


def _fp8_dequantize_2d(q: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    full = scale_inv.repeat_interleave(FP8_BLOCK, 0).repeat_interleave(FP8_BLOCK, 1)[: q.shape[0], : q.shape[1]]
    return q.float() * full


def to_fp8_state_dict(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """FP8 e4m3 weights plus `{name}_scale_inv` block scales; everything else in bf16, as DeepSeek-V3 ships."""
    out: dict[str, torch.Tensor] = {}
    for name, t in sd.items():
        if _fp8_eligible(name, t) and t.ndim == 2:
            out[name], out[name + "_scale_inv"] = _fp8_quantize_2d(t)
        elif _fp8_eligible(name, t):  # fused 3D experts: one block grid per expert
            pairs = [_fp8_quantize_2d(t[e]) for e in range(t.shape[0])]
            out[name] = torch.stack([p[0] for p in pairs])
            out[name + "_scale_inv"] = torch.stack([p[1] for p in pairs])
        else:
            out[name] = t.to(torch.bfloat16)
    return out


def fp8_reference_state_dict(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The bf16 checkpoint holding exactly the values the FP8 checkpoint of `sd` represents."""
    fp8 = to_fp8_state_dict(sd)
    out: dict[str, torch.Tensor] = {}
    for name, t in fp8.items():
        if name.endswith("_scale_inv"):
            continue
        if t.dtype == torch.float8_e4m3fn:
            s = fp8[name + "_scale_inv"]
            if t.ndim == 2:
                value = _fp8_dequantize_2d(t, s)
            else:
                value = torch.stack([_fp8_dequantize_2d(t[e], s[e]) for e in range(t.shape[0])])
            exact = value.to(torch.bfloat16)
            assert torch.equal(exact.float(), value), name  # power-of-two scales: exact in bf16
            out[name] = exact
        else:
            out[name] = t
    return out


# --- tokenizer ----------------------------------------------------------------------------------------------------

SPECIAL_TOKENS = ("<|bos|>", "<|eos|>", "<|pad|>", "<|user|>", "<|assistant|>", "<|system|>")
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def build_tokenizer():
    """A byte-level BPE tokenizer: the 256 byte tokens, a few merges and six special tokens (ids 256-261)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel

    alphabet = ByteLevel.alphabet()
    byte_chars = sorted(alphabet, key=lambda ch: _byte_of(ch))
    vocab = {ch: i for i, ch in enumerate(byte_chars)}
    vocab.update({s: 256 + i for i, s in enumerate(SPECIAL_TOKENS)})
    merges = [("Ġ", "t"), ("h", "e"), ("i", "n"), ("Ġt", "he")]
    next_id = 256 + len(SPECIAL_TOKENS)
    for a, b in merges:
        vocab[a + b] = next_id
        next_id += 1
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    from tokenizers import AddedToken

    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in SPECIAL_TOKENS])
    return tok


def _byte_of(ch: str) -> int:
    # GPT-2 bytes_to_unicode: printable bytes map to themselves, the rest to 256 + n.
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(
        range(ord("®"), ord("ÿ") + 1))
    table = {b: chr(b) for b in printable}
    n = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + n)
            n += 1
    inverse = {c: b for b, c in table.items()}
    return inverse[ch]


def tokenizer_config() -> dict:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|bos|>",
        "eos_token": "<|eos|>",
        "pad_token": "<|pad|>",
        "model_max_length": 512,
        "chat_template": CHAT_TEMPLATE,
    }


# --- saving -------------------------------------------------------------------------------------------------------

_DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}


def _convert_dtype(sd: dict[str, torch.Tensor], dtype: str) -> dict[str, torch.Tensor]:
    if dtype == "fp8":
        return to_fp8_state_dict(sd)
    if dtype == "fp8_reference":
        return fp8_reference_state_dict(sd)
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {sorted(_DTYPES) + ['fp8', 'fp8_reference']}, not {dtype!r}")
    return {k: v.to(_DTYPES[dtype]) for k, v in sd.items()}


def _split_shards(names: list[str], num_shards: int) -> list[list[str]]:
    """Contiguous runs of tensor names; a weight and its `_scale_inv` stay in the same shard."""
    groups: list[list[str]] = []
    for name in names:
        if name.endswith("_scale_inv") and groups and groups[-1][-1] == name[: -len("_scale_inv")]:
            groups[-1].append(name)
        else:
            groups.append([name])
    per = math.ceil(len(groups) / num_shards)
    return [[name for group in groups[i:i + per] for name in group] for i in range(0, len(groups), per)]


def save_state_dict(sd: dict[str, torch.Tensor], out_dir: Path, num_shards: int = 1) -> list[str]:
    """Write safetensors shards (Hub layout); returns the shard file names."""
    from safetensors.torch import save_file

    names = sorted(sd)
    if num_shards <= 1:
        save_file({k: sd[k].contiguous() for k in names}, str(out_dir / "model.safetensors"),
                  metadata={"format": "pt"})
        return ["model.safetensors"]
    shards = _split_shards(names, num_shards)
    files, weight_map, total = [], {}, 0
    for i, group in enumerate(shards, start=1):
        fname = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file({k: sd[k].contiguous() for k in group}, str(out_dir / fname), metadata={"format": "pt"})
        files.append(fname)
        for k in group:
            weight_map[k] = fname
            total += sd[k].numel() * sd[k].element_size()
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True))
    return files


def save_tiny_checkpoint(family: str, out_dir: str | Path, *, seed: int = 0, layout: str = "per_expert",
                         dtype: str = "bf16", num_shards: int = 1, with_mtp: bool | None = None) -> Path:
    """Write a tiny checkpoint of `family` to `out_dir` (created) and return it.

    dtype: "f32", "bf16", "f16", "fp8" (e4m3 with 128x128 block scales) or "fp8_reference" (the bf16 values an
    "fp8" checkpoint of the same seed represents). num_shards > 1 writes the Hub's sharded layout with
    model.safetensors.index.json.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    sd = _convert_dtype(checkpoint_state_dict(family, seed=seed, layout=layout, with_mtp=with_mtp), dtype)
    save_state_dict(sd, out, num_shards)
    cfg = tiny_config(family).to_dict()
    cfg["architectures"] = [_ARCHITECTURES[family]]
    cfg["torch_dtype"] = "bfloat16" if dtype != "f32" else "float32"
    cfg.pop("dtype", None)
    if dtype == "fp8":
        cfg["quantization_config"] = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                      "weight_block_size": [FP8_BLOCK, FP8_BLOCK]}
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True))
    (out / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": 256, "eos_token_id": 257, "pad_token_id": 258}, indent=2, sort_keys=True))
    build_tokenizer().save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(), indent=2, sort_keys=True))
    return out


_ARCHITECTURES = {
    "olmoe": "OlmoeForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
    "glm4_moe": "Glm4MoeForCausalLM",
    "glm_moe_dsa": "GlmMoeDsaForCausalLM",
}


def load_reference_model(checkpoint_dir: str | Path) -> torch.nn.Module:
    """The checkpoint loaded back by transformers in float32, eval mode (the test oracle)."""
    transformers.logging.set_verbosity_error()  # MTP keys are "unexpected" by design
    model = AutoModelForCausalLM.from_pretrained(str(checkpoint_dir), dtype=torch.float32)
    return model.eval()
