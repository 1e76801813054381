"""Qwen3-MoE: per-head q/k RMSNorm, softmax top-k routing (norm_topk_prob), dense MLP on mlp_only_layers and
between sparse steps."""

from __future__ import annotations

from . import _common as c

MODEL_TYPE = "qwen3_moe"


def is_sparse(config: dict, i: int) -> bool:
    step = int(config.get("decoder_sparse_step") or 1)
    n_experts = c.num_experts(config)
    return i not in (config.get("mlp_only_layers") or []) and n_experts > 0 and (i + 1) % step == 0


def sliding_window(config: dict, i: int) -> int | None:
    if not config.get("use_sliding_window"):
        return None
    types = config.get("layer_types")
    if types is not None and types[i] != "sliding_attention":
        return None
    if types is None and i >= int(config.get("max_window_layers") or 0):
        return None
    return int(config["sliding_window"]) if config.get("sliding_window") else None


def build(config, weights, experts):
    spec = c.AttentionSpec(qk_norm="per_head")
    n_experts = c.num_experts(config)
    layers = []
    for i in range(int(config["num_hidden_layers"])):
        p = f"model.layers.{i}.mlp"
        if is_sparse(config, i):
            router = c.softmax_router(config, weights, f"{p}.gate.weight", n_experts,
                                      bool(config.get("norm_topk_prob", False)))
            ffn = c.moe(config, i, router, experts)
        else:
            ffn = c.swiglu(config, weights, p)
        attn = c.attention(config, weights, i, spec, sliding_window(config, i))
        layers.append(c.layer(c.norms(config, weights, i), attn, ffn))
    return c.assemble(MODEL_TYPE, config, weights, experts, layers)
