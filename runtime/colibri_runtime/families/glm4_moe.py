"""GLM-4.5 / GLM-4.6 (glm4_moe): partial rotary (default half the head), optional per-head q/k norm, QKV biases,
dense MLP on the first first_k_dense_replace layers, sigmoid routing with correction bias, group-limited selection
and routed scaling, plus shared experts. The trailing MTP layers (num_nextn_predict_layers) are not run here."""

from __future__ import annotations

from . import _common as c

MODEL_TYPE = "glm4_moe"


def build(config, weights, experts):
    n_experts = c.num_experts(config)
    spec = c.AttentionSpec(qk_norm="per_head" if config.get("use_qk_norm") else None,
                           qkv_bias=bool(config.get("attention_bias", False)), default_partial_rotary=0.5)
    first_dense = int(config.get("first_k_dense_replace") or 0)
    layers = []
    for i in range(int(config["num_hidden_layers"])):
        p = f"model.layers.{i}.mlp"
        if i >= first_dense:
            router = c.sigmoid_router(config, weights, p, n_experts)
            shared = c.swiglu(config, weights, f"{p}.shared_experts") if int(
                config.get("n_shared_experts") or 0) else None
            ffn = c.moe(config, i, router, experts, shared)
        else:
            ffn = c.swiglu(config, weights, p)
        layers.append(c.layer(c.norms(config, weights, i), c.attention(config, weights, i, spec), ffn))
    return c.assemble(MODEL_TYPE, config, weights, experts, layers)
