"""DeepSeek-V3 (deepseek_v3): Multi-head Latent Attention over a compressed per-token state (mla.py), a dense MLP on
the first first_k_dense_replace layers, then MoE layers with sigmoid routing (e_score_correction_bias, group-limited
top-k, routed_scaling_factor) plus shared experts. The MTP layer stored after the last decoder layer (the
container's mtp group) is not part of the main forward.

`build_mla_attention` and `build_ffn` are shared with glm_moe_dsa, which is this architecture plus DSA."""

from __future__ import annotations

from colibri_format.errors import RuntimeModelError

from .. import mla
from ..layers import RMSNorm, RotaryEmbedding
from ..model import context_limit
from . import _common as c

MODEL_TYPE = "deepseek_v3"


def latent_norm(x, weight):
    return RMSNorm(weight, mla.LATENT_NORM_EPS)(x)


def mla_weights(weights, layer: int) -> mla.MLAWeights:
    p = f"model.layers.{layer}.self_attn"
    lora = f"{p}.q_a_proj.weight" in weights
    return mla.MLAWeights(
        kv_a_proj=weights.linear(f"{p}.kv_a_proj_with_mqa"),
        kv_a_norm=weights.f32(f"{p}.kv_a_layernorm.weight"),
        kv_b=weights.f32(f"{p}.kv_b_proj.weight"),
        o_proj=weights.linear(f"{p}.o_proj"),
        q_proj=None if lora else weights.linear(f"{p}.q_proj"),
        q_a_proj=weights.linear(f"{p}.q_a_proj") if lora else None,
        q_a_norm=weights.f32(f"{p}.q_a_layernorm.weight") if lora else None,
        q_b_proj=weights.linear(f"{p}.q_b_proj") if lora else None,
    )


def build_mla_attention(
    config: dict, weights, layer: int, cfg: mla.MLAConfig, indexer=None, shares_selection: bool = False
) -> mla.MLAAttention:
    if (cfg.q_lora_rank is None) == (f"model.layers.{layer}.self_attn.q_a_proj.weight" in weights):
        raise RuntimeModelError(
            f"layer {layer}: q_lora_rank in config.json does not match the stored q projections"
        )
    layout = "interleaved" if cfg.rope_interleave else "half"
    rope = RotaryEmbedding.from_config(config, cfg.qk_rope_head_dim, layout)
    return mla.MLAAttention.create(
        cfg, mla_weights(weights, layer), rope, context_limit(config), latent_norm, indexer, shares_selection
    )


def build_ffn(config: dict, weights, experts, layer: int, sparse: bool):
    p = f"model.layers.{layer}.mlp"
    if not sparse:
        return c.swiglu(config, weights, p)
    n_experts = int(config.get("n_routed_experts") or config["num_local_experts"])
    router = c.sigmoid_router(config, weights, p, n_experts)
    shared = (
        c.swiglu(config, weights, f"{p}.shared_experts") if int(config.get("n_shared_experts") or 0) else None
    )
    return c.moe(config, layer, router, experts, shared)


def sparse_layers(config: dict) -> list[bool]:
    layers = int(config["num_hidden_layers"])
    types = config.get("mlp_layer_types")
    if types:
        return [t == "sparse" for t in types[:layers]]
    first_dense = int(config.get("first_k_dense_replace") or 0)
    return [i >= first_dense for i in range(layers)]


def build(config, weights, experts):
    cfg = mla.MLAConfig.from_hf(config)
    layers = []
    for i, sparse in enumerate(sparse_layers(config)):
        attn = build_mla_attention(config, weights, i, cfg)
        layers.append(
            c.layer(c.norms(config, weights, i), attn, build_ffn(config, weights, experts, i, sparse))
        )
    model = c.assemble(MODEL_TYPE, config, weights, experts, layers)
    model.state_tag = "mla"
    return model
