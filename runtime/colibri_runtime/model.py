"""The generic decoder: embeddings, a stack of pre-norm decoder layers, final norm, LM head; per-sequence state.

How a family plugs in
---------------------
A family is one module `colibri_runtime/families/<model_type>.py` listed in `families.FAMILIES`. It exposes

    MODEL_TYPE = "<model_type>"
    def build(config: dict, weights: Weights, experts: ExpertProvider) -> DecoderModel

`config` is the container's config.json as a dict; `weights` answers resident tensors by Hugging Face checkpoint
name (`weights.linear(prefix)`, `weights.f32(name)`, `weights.qt(name)`, `weights.first(*candidates)`);
`experts` is the only access to routed experts (`get(layer, ids) -> [PreparedExpert]`). `build` returns a
`DecoderModel` assembled from shared pieces (layers.py) or its own, each honouring these small protocols:

- attention: `new_cache() -> state` (any object; one per layer per sequence) and
  `__call__(x[n, hidden], positions[n], state) -> [n, hidden]` for the n new rows of ONE sequence, appending them
  to `state`. It must compute each row from that row and the cached state only (GQA: layers.GQAAttention with
  layers.KVCache; MLA keeps its compressed latent state instead).
- ffn: `__call__(x[n, hidden]) -> [n, hidden]`, rows independent (layers.SwiGLU, layers.MoE).
- norms: `__call__(x) -> x` (layers.RMSNorm).
A layer that does not fit the pre-norm shape (x + attn(norm(x)); x + ffn(norm(x))) may subclass DecoderLayer and
override `forward`.

Determinism contract: the logits of a sequence depend only on its own tokens, never on which other sequences share
the batch, how its prompt was chunked, or where experts were cached. The MLP/MoE parts run on the rows of all
sequences at once (batch-union of experts); attention runs per sequence.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from colibri_format.errors import RuntimeModelError
from colibri_format.quant import QuantizedTensor, dequantize

from .layers import RMSNorm
from . import timesplit
from .weights import ExpertProvider, Linear

F32 = np.float32


class Attention(Protocol):
    def new_cache(self) -> Any: ...

    def __call__(self, x: np.ndarray, positions: np.ndarray, cache: Any) -> np.ndarray: ...


@dataclass(frozen=True)
class DecoderLayer:
    """x + attention(input_norm(x)), then x + ffn(post_norm(x))."""

    input_norm: RMSNorm
    attention: Attention
    post_norm: RMSNorm
    ffn: Any

    def forward(self, h: np.ndarray, segments: list[tuple[int, int]], positions: np.ndarray,
                caches: list[Any], after_attention: Callable[[np.ndarray], None] | None = None) -> np.ndarray:
        t0 = timesplit.clock()
        normed = self.input_norm(h)
        attn = np.empty_like(h)
        for (start, stop), cache in zip(segments, caches):
            attn[start:stop] = self.attention(normed[start:stop], positions[start:stop], cache)
        h = h + attn
        timesplit.SPLIT.attention += timesplit.clock() - t0
        if after_attention is not None:
            after_attention(h)
        return h + self.ffn(self.post_norm(h))


@dataclass(frozen=True)
class Embedding:
    """Token embeddings, decoded row by row from their stored encoding (int8 stays int8 in memory)."""

    table: QuantizedTensor

    @property
    def vocab_size(self) -> int:
        return int(self.table.shape[0])

    def __call__(self, ids: np.ndarray) -> np.ndarray:
        ids = np.asarray(ids, dtype=np.int64)
        if ids.size and (ids.min() < 0 or ids.max() >= self.vocab_size):
            raise RuntimeModelError(f"token id out of range for a vocabulary of {self.vocab_size}")
        t = self.table
        rows = QuantizedTensor(t.encoding, (len(ids), int(t.shape[1])), np.asarray(t.data)[ids],
                               None if t.scales is None else np.asarray(t.scales)[ids])
        return dequantize(rows).astype(F32)


@dataclass
class SequenceState:
    """Everything a sequence carries between forwards: one attention state per layer and the tokens consumed."""

    caches: list[Any]
    tokens: list[int] = field(default_factory=list)

    @property
    def length(self) -> int:
        return len(self.tokens)

    def rollback(self) -> bool:
        """Drop cached entries beyond the recorded tokens (after a forward interrupted half-way). False if some
        layer's state cannot be truncated; the caller must then start a new state."""
        for cache in self.caches:
            truncate = getattr(cache, "truncate", None)
            if truncate is None:
                return False
            truncate(self.length)
        return True


@dataclass
class DecoderModel:
    family: str
    config: dict
    embed: Embedding
    layers: list[DecoderLayer]
    norm: RMSNorm
    lm_head: Linear
    experts: ExpertProvider
    max_positions: int
    weights: Any = None

    @property
    def vocab_size(self) -> int:
        return self.lm_head.out_features

    def new_state(self) -> SequenceState:
        return SequenceState([layer.attention.new_cache() for layer in self.layers])

    def forward(self, tokens: list[np.ndarray], states: list[SequenceState], all_logits: bool = False
                ) -> list[np.ndarray]:
        """Run new tokens of several sequences (one array per sequence) through the model, appending them to each
        sequence's state. Returns per sequence the logits (n_i, vocab) of every new position if all_logits, else of
        the last one (1, vocab)."""
        if len(tokens) != len(states):
            raise RuntimeModelError("forward needs one state per token array")
        tokens = [np.asarray(t, dtype=np.int64).reshape(-1) for t in tokens]
        segments, positions, start = [], [], 0
        for t, s in zip(tokens, states):
            if s.length + len(t) > self.max_positions:
                from .layers import ContextLimitError

                raise ContextLimitError(f"context limit reached: {s.length + len(t)} positions > "
                                        f"{self.max_positions} (max_position_embeddings); start a new "
                                        "conversation or shorten the prompt")
            segments.append((start, start + len(t)))
            positions.append(np.arange(s.length, s.length + len(t), dtype=np.int64))
            start += len(t)
        if start == 0:
            return [np.zeros((0, self.vocab_size), F32) for _ in tokens]
        h = self.embed(np.concatenate(tokens))
        pos = np.concatenate(positions)
        self.experts.count_tokens(start)
        for i, layer in enumerate(self.layers):
            hook = self._lookahead(i)
            caches = [s.caches[i] for s in states]
            h = layer.forward(h, segments, pos, caches, after_attention=hook) if hook else layer.forward(
                h, segments, pos, caches)
        for t, s in zip(tokens, states):
            s.tokens.extend(int(x) for x in t)
        if all_logits:
            picked = h
            out_segments = segments
        else:
            picked = h[[stop - 1 for _, stop in segments]]
            out_segments = [(i, i + 1) for i in range(len(segments))]
        logits = self.lm_head(self.norm(picked))
        return [logits[a:b] for a, b in out_segments]

    def _lookahead(self, i: int) -> Callable[[np.ndarray], None] | None:
        """Router lookahead: after layer i's attention, route the current hidden state with layer i+1's router
        and tell the expert provider which experts layer i+1 will probably want, so it can start loading them.
        Only advice: the real routing of layer i+1 is computed as always, so results never change."""
        if not getattr(self.experts, "prefetch_enabled", False) or i + 1 >= len(self.layers):
            return None
        nxt = self.layers[i + 1]
        router = getattr(nxt.ffn, "router", None)
        if router is None:
            return None

        def hint(h: np.ndarray) -> None:
            _, ids = router.route(nxt.post_norm(h))
            self.experts.hint(nxt.ffn.layer, ids)

        return hint

    def prefill(self, tokens: np.ndarray, state: SequenceState, chunk_size: int = 512,
                all_logits: bool = False) -> np.ndarray:
        """Feed a prompt in chunks of `chunk_size`; returns the last position's logits (or all, if asked).
        Chunking never changes a bit of the result."""
        tokens = np.asarray(tokens, dtype=np.int64).reshape(-1)
        outs = []
        for start in range(0, len(tokens), max(1, chunk_size)):
            outs.append(self.forward([tokens[start:start + chunk_size]], [state], all_logits=all_logits)[0])
        if not outs:
            raise RuntimeModelError("cannot prefill an empty prompt")
        return np.concatenate(outs) if all_logits else outs[-1]


# --- helpers families share ---------------------------------------------------------------------------------------


def context_limit(config: dict) -> int:
    limit = config.get("max_position_embeddings")
    if not limit:
        raise RuntimeModelError("config.json has no max_position_embeddings; cannot size the KV cache")
    return int(limit)


def lm_head(config: dict, weights) -> Linear:
    """The output projection; tied to the embeddings when the config says so or the checkpoint has no lm_head."""
    name = weights.first("lm_head.weight")
    if name is None or (config.get("tie_word_embeddings") and name is None):
        return weights.linear("model.embed_tokens")
    return weights.linear("lm_head")


def require(config: dict, *keys: str):
    missing = [k for k in keys if config.get(k) is None]
    if missing:
        raise RuntimeModelError(f"config.json lacks {', '.join(missing)}")
    return [config[k] for k in keys]
