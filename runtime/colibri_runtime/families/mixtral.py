"""Mixtral: softmax top-k routing always renormalised, optional sliding window; the router lives at
block_sparse_moe.gate in original checkpoints and mlp.gate in re-saved ones."""

from __future__ import annotations

from colibri_format.errors import RuntimeModelError

from . import _common as c

MODEL_TYPE = "mixtral"


def build(config, weights, experts):
    n_experts = c.num_experts(config)
    spec = c.AttentionSpec()
    window = int(config["sliding_window"]) if config.get("sliding_window") else None
    layers = []
    for i in range(int(config["num_hidden_layers"])):
        name = weights.first(f"model.layers.{i}.block_sparse_moe.gate.weight", f"model.layers.{i}.mlp.gate.weight")
        if name is None:
            raise RuntimeModelError(f"layer {i} has no router (block_sparse_moe.gate or mlp.gate)")
        router = c.softmax_router(config, weights, name, n_experts, True)
        layers.append(c.layer(c.norms(config, weights, i), c.attention(config, weights, i, spec, window),
                              c.moe(config, i, router, experts)))
    return c.assemble(MODEL_TYPE, config, weights, experts, layers)
