"""Model dimensions read from a container's config.json, across the Hugging Face MoE families Colibri supports.

Families spell the same fact differently (`n_routed_experts`, `num_experts`, `num_local_experts`; dense first layers
as `first_k_dense_replace` or `mlp_only_layers`/`decoder_sparse_step`). `ModelDims.from_config` folds them into one
record so verification, planning and reports never look at raw config keys.
"""

from __future__ import annotations

from dataclasses import dataclass


def _int(config: dict, *keys: str, default: int = 0) -> int:
    for key in keys:
        value = config.get(key)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return default


@dataclass(frozen=True)
class ModelDims:
    """What the inspector needs to know about a model's shape."""

    family: str
    layers: int  # decoder layers (num_hidden_layers), MTP layers not counted
    hidden: int
    vocab: int
    num_experts: int  # routed experts per MoE layer
    top_k: int  # routed experts activated per token per MoE layer
    moe_intermediate: int  # width of one routed expert
    moe_layers: tuple[int, ...]  # decoder layers with routed experts
    mtp_layers: int  # multi-token-prediction layers (stored after the decoder layers)
    shared_experts: int
    attention_heads: int
    kv_heads: int
    head_dim: int
    kv_lora_rank: int  # > 0 for multi-head latent attention (MLA)
    qk_rope_head_dim: int
    max_positions: int
    tie_word_embeddings: bool

    @classmethod
    def from_config(cls, family: str, config: dict) -> ModelDims:
        layers = _int(config, "num_hidden_layers")
        hidden = _int(config, "hidden_size")
        experts = _int(config, "n_routed_experts", "num_experts", "num_local_experts")
        moe_intermediate = _int(config, "moe_intermediate_size")
        if not moe_intermediate and experts:
            moe_intermediate = _int(config, "intermediate_size")  # mixtral, olmoe: experts use intermediate_size
        heads = _int(config, "num_attention_heads", default=1)
        return cls(
            family=family,
            layers=layers,
            hidden=hidden,
            vocab=_int(config, "vocab_size"),
            num_experts=experts,
            top_k=_int(config, "num_experts_per_tok", "moe_topk", default=min(experts, 1)),
            moe_intermediate=moe_intermediate,
            moe_layers=_moe_layers(config, layers, experts),
            mtp_layers=_int(config, "num_nextn_predict_layers"),
            shared_experts=_int(config, "n_shared_experts", default=1 if config.get("shared_expert_intermediate_size") else 0),
            attention_heads=heads,
            kv_heads=_int(config, "num_key_value_heads", default=heads),
            head_dim=_int(config, "head_dim", default=hidden // max(heads, 1)),
            kv_lora_rank=_int(config, "kv_lora_rank"),
            qk_rope_head_dim=_int(config, "qk_rope_head_dim"),
            max_positions=_int(config, "max_position_embeddings"),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        )

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def experts_per_token(self) -> int:
        """Routed expert activations per generated token, over all MoE layers."""
        return self.top_k * len(self.moe_layers)

    def kv_bytes_per_token(self, bytes_per_value: int = 4) -> int:
        """KV cache bytes one token costs over all layers: MLA keeps the latent plus the rope key (576 floats per
        layer on GLM-5), other attention keeps keys and values of every KV head."""
        per_layer = self.kv_lora_rank + self.qk_rope_head_dim if self.is_mla else 2 * self.kv_heads * self.head_dim
        return per_layer * self.layers * bytes_per_value

    def expected_expert_shapes(self) -> dict[str, list[int]] | None:
        if not (self.moe_intermediate and self.hidden):
            return None
        i, h = self.moe_intermediate, self.hidden
        return {"gate": [i, h], "up": [i, h], "down": [h, i]}

    def to_json(self) -> dict:
        return {
            "family": self.family,
            "layers": self.layers,
            "hidden_size": self.hidden,
            "vocab_size": self.vocab,
            "num_experts": self.num_experts,
            "experts_per_token": self.top_k,
            "moe_intermediate_size": self.moe_intermediate,
            "moe_layers": len(self.moe_layers),
            "first_moe_layer": self.moe_layers[0] if self.moe_layers else None,
            "mtp_layers": self.mtp_layers,
            "shared_experts": self.shared_experts,
            "attention_heads": self.attention_heads,
            "kv_heads": self.kv_heads,
            "head_dim": self.head_dim,
            "attention": "mla" if self.is_mla else "mha/gqa",
            "kv_lora_rank": self.kv_lora_rank,
            "max_position_embeddings": self.max_positions,
        }


def _moe_layers(config: dict, layers: int, experts: int) -> tuple[int, ...]:
    if not experts:
        return ()
    if "first_k_dense_replace" in config:  # deepseek_v3, glm4_moe, glm_moe_dsa, kimi
        first = _int(config, "first_k_dense_replace")
        freq = max(_int(config, "moe_layer_freq", default=1), 1)
        return tuple(i for i in range(first, layers) if (i - first) % freq == 0)
    if "decoder_sparse_step" in config or "mlp_only_layers" in config:  # qwen2_moe, qwen3_moe
        step = max(_int(config, "decoder_sparse_step", default=1), 1)
        dense = set(config.get("mlp_only_layers") or [])
        return tuple(i for i in range(layers) if i not in dense and (i + 1) % step == 0)
    if isinstance(config.get("mlp_layer_types"), list):
        return tuple(i for i, t in enumerate(config["mlp_layer_types"][:layers]) if t != "dense")
    return tuple(range(layers))  # mixtral, olmoe: every layer is MoE
