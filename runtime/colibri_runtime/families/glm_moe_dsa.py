"""GLM-5 (glm_moe_dsa): DeepSeek-V3's architecture (MLA with interleaved RoPE, dense first layers, sigmoid-routed
MoE with shared experts) plus DeepSeek Sparse Attention: on "full" layers a lightning indexer (dsa.py) picks the
index_topk keys each query attends to; "shared" layers reuse the selection of the full layer below them.

Per token a full layer keeps latent + rope key + indexer key; a shared layer latent + rope key.

`dsa_mode` (argument, or the config key "colibri_dsa") chooses how attention uses the indexer: "sparse" (the model as
trained, default), "all" (every indexer selects every key: dense attention reproduced bit for bit through the sparse
machinery, the faithfulness check) or "off" (no indexer at all: plain dense MLA, no indexer keys kept). It changes the
numerics, so it is part of the session state tag."""

from __future__ import annotations

from dataclasses import dataclass, fields

from colibri_format.errors import RuntimeModelError

from .. import dsa, mla
from ..model import DecoderModel, SequenceState
from . import _common as c
from .deepseek_v3 import build_ffn, build_mla_attention, sparse_layers

MODEL_TYPE = "glm_moe_dsa"


@dataclass
class DsaDecoderModel(DecoderModel):
    """A DecoderModel whose new sequence state links each shared DSA layer's cache to its full layer's cache."""

    shared_from: tuple[int | None, ...] = ()
    state_tag: str = "dsa=sparse"

    def new_state(self) -> SequenceState:
        state = super().new_state()
        for i, src in enumerate(self.shared_from):
            if src is not None:
                state.caches[i].source = state.caches[src]
        return state


def indexer_weights(weights, layer: int) -> dsa.IndexerWeights:
    p = f"model.layers.{layer}.self_attn.indexer"
    return dsa.IndexerWeights(
        wq_b=weights.linear(f"{p}.wq_b"),
        wk=weights.linear(f"{p}.wk"),
        k_norm_weight=weights.f32(f"{p}.k_norm.weight"),
        k_norm_bias=weights.f32(f"{p}.k_norm.bias"),
        weights_proj=weights.linear(f"{p}.weights_proj"),
    )


DSA_MODES = ("sparse", "all", "off")


def build(config, weights, experts, dsa_mode: str | None = None):
    mode = dsa_mode or str(config.get("colibri_dsa", "sparse"))
    if mode not in DSA_MODES:
        raise RuntimeModelError(f"unknown DSA mode {mode!r}; use one of {', '.join(DSA_MODES)}")
    cfg = mla.MLAConfig.from_hf(config, force_interleave=True)  # GLM-5 always rotates interleaved pairs
    icfg = dsa.IndexerConfig.from_hf(config)
    full = dsa.indexer_full_layers(config)
    if not full or not full[0]:
        raise RuntimeModelError(
            "glm_moe_dsa: the first layer must run its own indexer (indexer_types[0] == 'full')"
        )
    layers, shared_from, last_full = [], [], None
    for i, sparse in enumerate(sparse_layers(config)):
        if mode == "off":
            for name in [n for n in weights.names if n.startswith(f"model.layers.{i}.self_attn.indexer.")]:
                weights.qt(name)  # deliberately unused, not missing
            attn = build_mla_attention(config, weights, i, cfg)
            shared_from.append(None)
        elif full[i]:
            indexer = dsa.Indexer(icfg, indexer_weights(weights, i), select_all=mode == "all")
            attn = build_mla_attention(config, weights, i, cfg, indexer=indexer)
            last_full = i
            shared_from.append(None)
        else:
            attn = build_mla_attention(config, weights, i, cfg, shares_selection=True)
            shared_from.append(last_full)
        layers.append(
            c.layer(c.norms(config, weights, i), attn, build_ffn(config, weights, experts, i, sparse))
        )
    base = c.assemble(MODEL_TYPE, config, weights, experts, layers)
    values = {f.name: getattr(base, f.name) for f in fields(DecoderModel)}
    return DsaDecoderModel(**values, shared_from=tuple(shared_from), state_tag=f"dsa={mode}")
