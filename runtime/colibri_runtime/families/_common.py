"""Assembly shared by the GQA families (olmoe, qwen2_moe, qwen3_moe, mixtral, glm4_moe): attention, norms, dense
MLPs, routers and shared experts from checkpoint names. A family module states only what differs."""

from __future__ import annotations

from dataclasses import dataclass

from colibri_format.errors import RuntimeModelError

from ..layers import GQAAttention, MoE, RMSNorm, RotaryEmbedding, SigmoidRouter, SoftmaxRouter, SwiGLU
from ..model import DecoderLayer, DecoderModel, Embedding, context_limit, lm_head, require
from ..weights import ExpertProvider, Weights


@dataclass(frozen=True)
class AttentionSpec:
    qk_norm: str | None = None  # None, "per_head" (qwen3/glm4) or "full" (olmoe: over the whole projection)
    qkv_bias: bool | None = None  # None: take biases when the checkpoint has them
    default_partial_rotary: float | None = None


def head_dim(config: dict) -> int:
    hidden, heads = require(config, "hidden_size", "num_attention_heads")
    return int(config.get("head_dim") or hidden // heads)


def rope_config(config: dict, spec: AttentionSpec) -> dict:
    cfg = dict(config)
    if spec.default_partial_rotary is not None:
        params = cfg.get("rope_parameters") or {}
        if "partial_rotary_factor" not in params and cfg.get("partial_rotary_factor") is None:
            cfg["partial_rotary_factor"] = spec.default_partial_rotary
    return cfg


def attention(config: dict, weights: Weights, layer: int, spec: AttentionSpec,
              sliding_window: int | None = None) -> GQAAttention:
    p = f"model.layers.{layer}.self_attn"
    heads = int(config["num_attention_heads"])
    kv_heads = int(config.get("num_key_value_heads") or heads)
    hd = head_dim(config)
    eps = float(config.get("rms_norm_eps", 1e-6))
    bias = spec.qkv_bias
    q_norm = k_norm = None
    if spec.qk_norm is not None:
        q_norm = RMSNorm(weights.f32(f"{p}.q_norm.weight"), eps)
        k_norm = RMSNorm(weights.f32(f"{p}.k_norm.weight"), eps)
    return GQAAttention(
        q_proj=weights.linear(f"{p}.q_proj", bias),
        k_proj=weights.linear(f"{p}.k_proj", bias),
        v_proj=weights.linear(f"{p}.v_proj", bias),
        o_proj=weights.linear(f"{p}.o_proj"),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=hd,
        rope=RotaryEmbedding.from_config(rope_config(config, spec), hd),
        scaling=hd**-0.5,
        limit=context_limit(config),
        q_norm=q_norm,
        k_norm=k_norm,
        qk_norm_per_head=spec.qk_norm == "per_head",
        clip_qkv=config.get("clip_qkv"),
        sliding_window=sliding_window,
    )


def swiglu(config: dict, weights: Weights, prefix: str) -> SwiGLU:
    return SwiGLU(weights.linear(f"{prefix}.gate_proj"), weights.linear(f"{prefix}.up_proj"),
                  weights.linear(f"{prefix}.down_proj"), config.get("hidden_act", "silu"))


def softmax_router(config: dict, weights: Weights, name: str, num_experts: int, norm_topk_prob: bool
                   ) -> SoftmaxRouter:
    lin = weights.linear(name[: -len(".weight")])
    if lin.out_features != num_experts:
        raise RuntimeModelError(f"router {name} has {lin.out_features} outputs, config says {num_experts} experts")
    return SoftmaxRouter(lin, int(config["num_experts_per_tok"]), norm_topk_prob)


def sigmoid_router(config: dict, weights: Weights, prefix: str, num_experts: int) -> SigmoidRouter:
    bias_name = weights.first(f"{prefix}.e_score_correction_bias", f"{prefix}.gate.e_score_correction_bias")
    return SigmoidRouter(
        weight=weights.linear(f"{prefix}.gate"),
        top_k=int(config["num_experts_per_tok"]),
        norm_topk_prob=bool(config.get("norm_topk_prob", True)),
        correction_bias=None if bias_name is None else weights.f32(bias_name),
        n_group=int(config.get("n_group") or 1),
        topk_group=int(config.get("topk_group") or 1),
        routed_scaling_factor=float(config.get("routed_scaling_factor") or 1.0),
    )


def norms(config: dict, weights: Weights, layer: int) -> tuple[RMSNorm, RMSNorm]:
    eps = float(config.get("rms_norm_eps", 1e-6))
    p = f"model.layers.{layer}"
    return (RMSNorm(weights.f32(f"{p}.input_layernorm.weight"), eps),
            RMSNorm(weights.f32(f"{p}.post_attention_layernorm.weight"), eps))


def assemble(family: str, config: dict, weights: Weights, experts: ExpertProvider, layers: list[DecoderLayer]
             ) -> DecoderModel:
    eps = float(config.get("rms_norm_eps", 1e-6))
    return DecoderModel(
        family=family,
        config=config,
        embed=Embedding(weights.qt("model.embed_tokens.weight")),
        layers=layers,
        norm=RMSNorm(weights.f32("model.norm.weight"), eps),
        lm_head=lm_head(config, weights),
        experts=experts,
        max_positions=context_limit(config),
        weights=weights,
    )


def layer(norm_pair: tuple[RMSNorm, RMSNorm], attn, ffn) -> DecoderLayer:
    return DecoderLayer(norm_pair[0], attn, norm_pair[1], ffn)


def moe(config: dict, layer_idx: int, router, experts: ExpertProvider, shared=None, shared_gate=None) -> MoE:
    return MoE(layer_idx, router, experts, shared, shared_gate, config.get("hidden_act", "silu"))


def num_experts(config: dict) -> int:
    """Routed experts per MoE layer; checkpoints spell it num_experts, num_local_experts or n_routed_experts."""
    for key in ("num_experts", "num_local_experts", "n_routed_experts"):
        if config.get(key):
            return int(config[key])
    return 0
