"""The tier cache: a "JIT for weights" between the model and the drives.

Tiers, fastest first: the pinned hot set (learned from `.coli_usage`, never evicted), a per-layer LRU, then the
drives (through `expert_io.RecordReader` on a pool of reader threads). A VRAM tier would sit in front of the pinned
set behind the same `ExpertProvider` interface.

Router-lookahead prefetch: the model calls `hint(layer, ids)` with the experts that layer's router predicts from an
earlier hidden state; missing ones start loading on the I/O pool. When the model then asks for a layer, a prefetched
expert is picked up; a prefetch that has not started yet is cancelled and read on the spot (stale work is dropped);
prefetched experts the layer did not ask for are dropped. Precision and recall of the predictions are counted.

Every tier hands out the same bytes, decoded the same way, so placement never changes a result. Read buffers are
reused: an expert that leaves the cache gives its buffer back once the model asks for the next layer (by then the
layer that used it has been computed), which spares the kernel a zeroed page per 4 KiB on every read.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass, field

import numpy as np

from .expert_io import IOPool, RecordReader
from .weights import ExpertStats, PreparedExpert


@dataclass
class TierStats(ExpertStats):
    """ExpertStats plus where each hit came from, prefetch quality and time spent waiting for the drives."""

    pinned_hits: int = 0
    lru_hits: int = 0
    prefetch_hits: int = 0
    misses: int = 0
    predicted: int = 0
    predicted_used: int = 0
    wanted_after_hint: int = 0
    prefetch_reads: int = 0
    prefetch_wasted: int = 0
    disk_wait_seconds: float = 0.0
    read_seconds: float = 0.0
    bytes_by_drive: dict[str, int] = field(default_factory=dict)

    @property
    def precision(self) -> float:
        return self.predicted_used / self.predicted if self.predicted else 0.0

    @property
    def recall(self) -> float:
        return self.predicted_used / self.wanted_after_hint if self.wanted_after_hint else 0.0

    @property
    def read_gbps(self) -> float:
        return self.bytes_read / self.read_seconds / 1e9 if self.read_seconds else 0.0


@dataclass(frozen=True)
class CachePlan:
    """How many experts each tier holds. `lru_per_layer` experts per MoE layer; `pinned` explicit (layer, expert)s."""

    lru_per_layer: int
    pinned: tuple[tuple[int, int], ...] = ()


def plan_cache(
    budget_bytes: int, expert_bytes: int, layers: Sequence[int], pin_bytes: int, hot: Sequence[tuple[int, int]]
) -> CachePlan:
    """Split an expert-cache budget between pinned experts (the hottest first, up to pin_bytes) and per-layer LRUs."""
    if expert_bytes <= 0 or not layers:
        return CachePlan(0, ())
    pin_count = max(0, min(len(hot), int(min(pin_bytes, budget_bytes) // expert_bytes)))
    pinned = tuple(hot[:pin_count])
    remaining = max(0, budget_bytes - pin_count * expert_bytes)
    return CachePlan(int(remaining // expert_bytes // len(layers)), pinned)


def hottest_experts(counts: np.ndarray, layers: Sequence[int], min_heat: float = 0.0) -> list[tuple[int, int]]:
    """(layer, expert) of every expert with a non-zero count above `min_heat` times its layer's mean count, hottest
    first (ties by layer, then expert)."""
    out = []
    for layer in layers:
        if layer < counts.shape[0]:
            row = counts[layer]
            floor = min_heat * float(row.mean()) if row.size else 0.0
            for e in np.nonzero((row > 0) & (row > floor))[0]:
                out.append((float(counts[layer, e]), int(layer), int(e)))
    out.sort(key=lambda t: (-t[0], t[1], t[2]))
    return [(layer, e) for _, layer, e in out]


class TieredExpertProvider:
    """An ExpertProvider with pinned + per-layer LRU tiers, async reads and lookahead prefetch."""

    def __init__(
        self,
        container,
        plan: CachePlan,
        reader: RecordReader | None = None,
        io_threads: int = 4,
        prefetch: bool = True,
        verify_reads: bool = False,
        trace=None,
        spare_buffers: int = 16,
    ) -> None:
        self.container = container
        self.plan = plan
        self.reader = reader or RecordReader(container)
        self.pool = IOPool(io_threads)
        self.prefetch_enabled = prefetch
        self.verify_reads = verify_reads
        self.trace = trace  # a trace.TraceRecorder, or None
        self.stats = TierStats()
        self._pinned: dict[tuple[int, int], PreparedExpert] = {}
        self._lru: dict[int, OrderedDict[int, PreparedExpert]] = {}
        self._inflight: dict[tuple[int, int], Future] = {}
        self._hinted: dict[int, set[int]] = {}
        self._stats_lock = threading.Lock()
        self._pool_lock = threading.Lock()
        self._free: dict[int, list] = {}
        self._quarantine: list = []
        self._buffer_of: dict[tuple[int, int], object] = {}
        self.spare_buffers = spare_buffers  # free read buffers kept for reuse; more are released to the OS
        self.routing_counts = np.zeros((self._num_layer_slots(), max(1, container.num_experts)), dtype=np.float32)
        self._load_pinned()

    def _num_layer_slots(self) -> int:
        layers = self.container.expert_layers
        n = int(self.container.config.get("num_hidden_layers", 0))
        return max(n, (max(layers) + 1) if layers else 0)

    # --- loading --------------------------------------------------------------------------------------------------

    def _load(self, layer: int, expert: int) -> tuple[PreparedExpert, int, str, float]:
        result = self.reader.read(layer, expert, self._take_buffer(layer, expert))
        view = memoryview(result.buffer)[: result.length]
        if self.verify_reads:
            self.container.verify_record_bytes(layer, expert, view)
        record = self.container.decode_record(view, layer, expert)
        with self._pool_lock:
            self._buffer_of[(layer, expert)] = result.buffer
        return PreparedExpert.from_record(record), result.length, result.drive, result.seconds

    # --- read buffers: reused, because a fresh buffer costs the kernel a page fault and a zeroed page per 4 KiB ---

    def _take_buffer(self, layer: int, expert: int):
        size = self.container.record_location(layer, expert).padded_length
        with self._pool_lock:
            free = self._free.get(size)
            return free.pop() if free else None

    def _retire(self, key: tuple[int, int]) -> None:
        """The expert `key` left the cache: its buffer may be reused once the layer computing with it is done."""
        with self._pool_lock:
            buf = self._buffer_of.pop(key, None)
            if buf is not None:
                self._quarantine.append(buf)

    def _release_quarantine(self) -> None:
        """Called when the model asks for a layer: every expert handed out before has been computed with."""
        with self._pool_lock:
            for buf in self._quarantine:
                free = self._free.setdefault(len(buf), [])
                if len(free) < self.spare_buffers:
                    free.append(buf)
            self._quarantine.clear()

    def _load_pinned(self) -> None:
        futures = {key: self.pool.submit(self._load, *key) for key in self.plan.pinned}
        for key, fut in futures.items():
            prepared, nbytes, drive, seconds = fut.result()
            self._pinned[key] = prepared
            self._account_read(nbytes, drive, seconds)

    def _account_read(self, nbytes: int, drive: str, seconds: float) -> None:
        # Called on the main thread, and under _stats_lock from reader threads for discarded prefetches.
        self.stats.bytes_read += nbytes
        self.stats.read_seconds += seconds
        self.stats.bytes_by_drive[drive] = self.stats.bytes_by_drive.get(drive, 0) + nbytes

    # --- the ExpertProvider interface ------------------------------------------------------------------------------

    def hint(self, layer: int, expert_ids: Iterable[int]) -> None:
        if not self.prefetch_enabled:
            return
        matrix = np.asarray(list(expert_ids) if not isinstance(expert_ids, np.ndarray) else expert_ids)
        if self.trace is not None and matrix.ndim == 2:
            self.trace.predicted(layer, matrix)
        ids = {int(e) for e in matrix.reshape(-1)}
        self._hinted[layer] = ids
        for e in sorted(ids):
            key = (layer, e)
            if key in self._pinned or e in self._lru.get(layer, ()) or key in self._inflight:
                continue
            fut = self.pool.submit(self._load, layer, e)
            fut.colibri_key = key
            self._inflight[key] = fut
            self.stats.prefetch_reads += 1

    def count_tokens(self, n: int) -> None:
        self.stats.tokens += n

    def observe_routing(self, layer: int, ids: np.ndarray) -> None:
        """Per-token routing decisions (for .coli_usage): ids is (tokens, top_k)."""
        if layer < self.routing_counts.shape[0]:
            np.add.at(self.routing_counts[layer], np.asarray(ids).reshape(-1), 1.0)
        if self.trace is not None:
            self.trace.routed(layer, ids)

    def get(self, layer: int, expert_ids: Sequence[int]) -> list[PreparedExpert]:
        got = dict(self.request(layer, expert_ids))
        return [got[int(e)] for e in expert_ids]

    def request(self, layer: int, expert_ids: Sequence[int]) -> Iterator[tuple[int, PreparedExpert]]:
        """Start loading what is missing now; then yield (expert, prepared) as each becomes available: cached
        experts first, read ones as their reads complete. The caller computes with each as it comes, overlapping
        compute with the remaining reads (and must combine the results in a fixed order to keep its bits)."""
        self._release_quarantine()
        wanted = [int(e) for e in expert_ids]
        self._score_prediction(layer, wanted)
        lru = self._lru.setdefault(layer, OrderedDict())
        ready: list[tuple[int, PreparedExpert]] = []
        pending: dict[Future, int] = {}
        misses = 0
        for e in wanted:
            key = (layer, e)
            if key in self._pinned:
                ready.append((e, self._pinned[key]))
                self.stats.pinned_hits += 1
            elif e in lru:
                lru.move_to_end(e)
                ready.append((e, lru[e]))
                self.stats.lru_hits += 1
            else:
                fut = self._inflight.pop(key, None)
                if fut is not None and fut.cancel():
                    fut = None  # the prefetch had not started: stale work dropped, read it now
                if fut is None:
                    fut = self.pool.submit(self._load, layer, e)
                    misses += 1
                else:
                    self.stats.prefetch_hits += 1
                pending[fut] = e
        self._drop_unused_prefetches(layer, set(wanted))
        self.stats.misses += misses
        self.stats.requests += 1
        self.stats.loaded += len(wanted)
        self.stats.hits += len(wanted) - misses  # pinned, LRU and prefetched: no demand read was waited for
        self.stats.per_layer[layer] = self.stats.per_layer.get(layer, 0) + len(wanted)
        return self._deliver(layer, ready, pending)

    def _deliver(self, layer: int, ready, pending: dict[Future, int]) -> Iterator[tuple[int, PreparedExpert]]:
        yield from ready
        while pending:
            t0 = time.perf_counter()
            done, _ = wait(list(pending), return_when=FIRST_COMPLETED)
            self.stats.disk_wait_seconds += time.perf_counter() - t0
            for fut in sorted(done, key=lambda f: pending[f]):
                e = pending.pop(fut)
                prepared, nbytes, drive, seconds = fut.result()
                with self._stats_lock:
                    self._account_read(nbytes, drive, seconds)
                self._insert(layer, e, prepared)
                yield e, prepared

    # --- internals ------------------------------------------------------------------------------------------------

    def _insert(self, layer: int, expert: int, prepared: PreparedExpert) -> None:
        capacity = self.plan.lru_per_layer
        if capacity <= 0:
            self._retire((layer, expert))
            return
        lru = self._lru[layer]
        lru[expert] = prepared
        lru.move_to_end(expert)
        while len(lru) > capacity:
            evicted, _ = lru.popitem(last=False)
            self._retire((layer, evicted))

    def _score_prediction(self, layer: int, wanted: list[int]) -> None:
        predicted = self._hinted.pop(layer, None)
        if predicted is None:
            return
        used = len(predicted.intersection(wanted))
        self.stats.predicted += len(predicted)
        self.stats.predicted_used += used
        self.stats.wanted_after_hint += len(wanted)

    def _drop_unused_prefetches(self, layer: int, wanted: set[int]) -> None:
        """Prefetches of this layer that it did not ask for: cancel them, or let them finish in the background and
        count their bytes; they are not cached (a wrong guess must not evict an expert that is in use)."""
        for key in [k for k in self._inflight if k[0] == layer and k[1] not in wanted]:
            fut = self._inflight.pop(key)
            self.stats.prefetch_wasted += 1
            if not fut.cancel():
                fut.add_done_callback(self._account_wasted)

    def _account_wasted(self, fut: Future) -> None:
        try:
            _, nbytes, drive, seconds = fut.result()
        except Exception:  # a failed read nobody waits for: the demand path reports real failures
            return
        with self._stats_lock:
            self._account_read(nbytes, drive, seconds)
        key = getattr(fut, "colibri_key", None)
        if key is not None:
            self._retire(key)

    @property
    def cached_bytes(self) -> int:
        pinned = sum(p.nbytes for p in self._pinned.values())
        return pinned + sum(p.nbytes for lru in self._lru.values() for p in lru.values())

    def take_turn_counts(self) -> np.ndarray:
        """The routing counts since the last call (for .coli_usage), and reset them."""
        counts = self.routing_counts
        self.routing_counts = np.zeros_like(counts)
        return counts

    def close(self) -> None:
        for fut in self._inflight.values():
            fut.cancel()
        self._inflight.clear()
        self.pool.shutdown()
        self.reader.close()
