"""Where a model's weights come from: resident tensors by checkpoint name, and the routed experts.

`Weights` answers tensors by their Hugging Face checkpoint name (from a Container or an in-memory dict of
QuantizedTensors) and hands out kernel-ready `Linear`s. `ExpertProvider` is the one door to routed experts: the
model asks `get(layer, expert_ids)` and receives `PreparedExpert`s; what sits behind it (plain container reads, a tier
cache with LRU/pinning/prefetch, async I/O) is the provider's business and must never change a result.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from colibri_format.errors import RuntimeModelError
from colibri_format.quant import QuantizedTensor, dequantize

from .kernels import PreparedWeight, linear, prepare_weight


@dataclass(frozen=True)
class Linear:
    """y = x @ W.T (+ b) with a deterministic kernel."""

    weight: PreparedWeight
    bias: np.ndarray | None = None

    @property
    def out_features(self) -> int:
        return self.weight.out_features

    @property
    def in_features(self) -> int:
        return self.weight.in_features

    def __call__(self, x: np.ndarray) -> np.ndarray:
        return linear(x, self.weight, self.bias)


class Weights:
    """Resident tensors by checkpoint name. `source` is a Container (anything with tensor_names()/tensor(name)) or a
    mapping name -> QuantizedTensor."""

    def __init__(self, source) -> None:
        self._source = source
        if isinstance(source, Mapping):
            self._names = set(source)
        else:
            self._names = set(source.tensor_names())
        self._used: set[str] = set()

    def __contains__(self, name: str) -> bool:
        return name in self._names

    @property
    def names(self) -> set[str]:
        return set(self._names)

    @property
    def unused(self) -> set[str]:
        """Tensors never asked for (a family that leaves some behind is probably missing a piece)."""
        return self._names - self._used

    def first(self, *candidates: str) -> str | None:
        """The first of several possible names that the checkpoint holds (families differ in naming)."""
        for name in candidates:
            if name in self._names:
                return name
        return None

    def qt(self, name: str) -> QuantizedTensor:
        if name not in self._names:
            raise RuntimeModelError(f"the container has no tensor {name!r}; it was converted for another family "
                                    "or is incomplete: re-run colibri-convert")
        self._used.add(name)
        if isinstance(self._source, Mapping):
            return self._source[name]
        return self._source.tensor(name)

    def f32(self, name: str) -> np.ndarray:
        """The tensor as float32 (norm weights, biases, small vectors)."""
        return np.ascontiguousarray(dequantize(self.qt(name)), dtype=np.float32)

    def maybe_f32(self, name: str) -> np.ndarray | None:
        return self.f32(name) if name in self._names else None

    def linear(self, prefix: str, bias: bool | None = None) -> Linear:
        """`prefix.weight` (and `prefix.bias` when present, or when bias=True demands it) as a Linear."""
        w = prepare_weight(self.qt(prefix + ".weight"))
        b = None
        if bias is None:
            b = self.maybe_f32(prefix + ".bias")
        elif bias:
            b = self.f32(prefix + ".bias")
        return Linear(w, b)


# --- routed experts -----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PreparedExpert:
    """One routed expert ready for the kernels: SwiGLU gate/up (intermediate, hidden) and down (hidden, intermediate)."""

    gate: PreparedWeight
    up: PreparedWeight
    down: PreparedWeight

    @property
    def nbytes(self) -> int:
        return self.gate.nbytes + self.up.nbytes + self.down.nbytes

    @classmethod
    def from_record(cls, record) -> PreparedExpert:
        """From anything with .gate/.up/.down QuantizedTensors (colibri_format.reader.ExpertRecord)."""
        return cls(prepare_weight(record.gate), prepare_weight(record.up), prepare_weight(record.down))


@dataclass
class ExpertStats:
    """Counters every provider keeps. `loaded`: experts handed to the model (one per distinct expert per layer per
    forward); `hits`: those served without reading storage; `bytes_read`: bytes read from storage."""

    requests: int = 0
    loaded: int = 0
    hits: int = 0
    bytes_read: int = 0
    tokens: int = 0
    per_layer: dict[int, int] = field(default_factory=dict)

    @property
    def hit_rate(self) -> float:
        return self.hits / self.loaded if self.loaded else 0.0

    @property
    def per_token(self) -> float:
        return self.loaded / self.tokens if self.tokens else 0.0

    def snapshot(self) -> ExpertStats:
        return ExpertStats(self.requests, self.loaded, self.hits, self.bytes_read, self.tokens, dict(self.per_layer))

    def since(self, earlier: ExpertStats) -> ExpertStats:
        return ExpertStats(self.requests - earlier.requests, self.loaded - earlier.loaded, self.hits - earlier.hits,
                           self.bytes_read - earlier.bytes_read, self.tokens - earlier.tokens)


class ExpertProvider(Protocol):
    """The model's only access to routed experts. Implementations must return the same numbers whatever they cache.

    get(layer, expert_ids) -> one PreparedExpert per id, in order (ids distinct, sorted ascending by the caller).
        What it returns is valid until the next get() call: a provider may reuse the memory of experts it evicts
        (the model computes a layer's experts before asking for the next layer's).
    hint(layer, expert_ids) -> advice that these experts will be wanted soon (prefetch); may be ignored.
    count_tokens(n) -> the model reports how many token positions it processed (for per-token statistics).
    """

    stats: ExpertStats

    def get(self, layer: int, expert_ids: Sequence[int]) -> list[PreparedExpert]: ...

    def hint(self, layer: int, expert_ids: Iterable[int]) -> None: ...

    def count_tokens(self, n: int) -> None: ...


class _BaseProvider:
    def __init__(self) -> None:
        self.stats = ExpertStats()

    def hint(self, layer: int, expert_ids: Iterable[int]) -> None:
        return None

    def count_tokens(self, n: int) -> None:
        self.stats.tokens += n

    def _count(self, layer: int, n: int, hits: int, nbytes: int) -> None:
        self.stats.requests += 1
        self.stats.loaded += n
        self.stats.hits += hits
        self.stats.bytes_read += nbytes
        self.stats.per_layer[layer] = self.stats.per_layer.get(layer, 0) + n


class ContainerExpertProvider(_BaseProvider):
    """Experts straight from the container's memory map: every request touches the mapped record (no cache of its
    own; the page cache decides what is in RAM). Counts each request as a read of the record's bytes."""

    def __init__(self, container) -> None:
        super().__init__()
        self._container = container

    def get(self, layer: int, expert_ids: Sequence[int]) -> list[PreparedExpert]:
        out = [PreparedExpert.from_record(self._container.expert(layer, int(e))) for e in expert_ids]
        self._count(layer, len(out), 0, sum(p.nbytes for p in out))
        return out


class MemoryExpertProvider(_BaseProvider):
    """Experts from an in-memory mapping (layer, expert) -> record with .gate/.up/.down, prepared once and kept:
    every request after the first of an expert is a hit."""

    def __init__(self, records: Mapping[tuple[int, int], object]) -> None:
        super().__init__()
        self._records = records
        self._prepared: dict[tuple[int, int], PreparedExpert] = {}

    def get(self, layer: int, expert_ids: Sequence[int]) -> list[PreparedExpert]:
        out, hits, nbytes = [], 0, 0
        for e in expert_ids:
            key = (layer, int(e))
            p = self._prepared.get(key)
            if p is None:
                if key not in self._records:
                    raise RuntimeModelError(f"no routed expert {key[1]} in layer {key[0]}")
                p = PreparedExpert.from_record(self._records[key])
                self._prepared[key] = p
                nbytes += p.nbytes
            else:
                hits += 1
            out.append(p)
        self._count(layer, len(out), hits, nbytes)
        return out
