"""Resumable conversion of a Hugging Face checkpoint into a Colibri container, one source shard at a time.

The unit of work is one source shard. For each unit the converter fetches the shard (a Hub source downloads it and
deletes it afterwards), classifies every tensor through the family plan, dequantizes it to float32 (bf16, f16, f32,
FP8 e4m3 with 128x128 block scales), encodes it with the recipe and writes the unit's data files
(`resident-uNNNNN.safetensors`, `mtp-uNNNNN.safetensors`, `experts-uNNNNN.colx`) under OUT_DIR/.colibri-convert/parts.
Expert parts (or FP8 weights and their scales) whose siblings live in a later shard are kept, already encoded, in a
per-unit pending file. The unit's state file `units/NNNNN.json`, written atomically last, is the commit point: a unit
without it is redone from scratch, and every file a unit writes is a pure function of the source and the parameters,
so a conversion killed at any moment (SIGKILL included) and run again yields a byte-identical container.

Once every unit is committed the converter checks completeness (missing tensors, missing experts), renames the unit
files to their final consecutive names, writes the verbatim files and hands over to `finalize_container`, which writes
the expert index and then the manifest: until that moment OUT_DIR is not a container.

Guards: an fcntl lock refuses a second converter on the same OUT_DIR; `params.json` records the recipe, family and
source identity, and a rerun with different ones is refused naming what differs (`restart=True` starts over);
the free-space floor is checked before each unit and stops cleanly, leaving a resumable state.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import signal
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from colibri_format.constants import (
    DEFAULT_RECIPE,
    EXPERT_FILE_PATTERN,
    EXPERT_INDEX_NAME,
    MANIFEST_NAME,
    MTP_FILE_PATTERN,
    RESIDENT_FILE_PATTERN,
    TENSOR_CLASSES,
    UNQUANTIZABLE_CLASSES,
    VERBATIM_FILES,
    Encoding,
)
from colibri_format.errors import ColibriError, ConversionError
from colibri_format.quant import QuantizedTensor, quantize
from colibri_format.safetensors_io import (
    DTYPES,
    NUMPY_TO_DTYPE,
    FileInfo,
    SafetensorsFile,
    write_arrays,
)
from colibri_format.writer import (
    ExpertFileWriter,
    IndexEntry,
    finalize_container,
    write_safetensors,
    write_verbatim,
)

from .families import ModelPlan, plan_for
from .families._base import MTP, ExpertPart, FusedExperts, Resident, resolve
from .fastquant import FAST_ENCODINGS, encode_bf16, relative_error, warm_up
from .shardio import ShardReader
from .sources import Source
from .tensors import FP8_DTYPES, SCALE_SUFFIX, fp8_to_f32, to_f32

CONVERTER_VERSION = 1
STATE_DIR = ".colibri-convert"
LOCK_NAME = ".colibri-convert.lock"
CRASH_ENV = "COLIBRI_CONVERT_CRASH_AT"  # fault injection for kill-and-resume tests: "unit3:files", ...
PARTS = ("gate", "up", "down")
GB = 1024**3


class DiskFloorReached(ConversionError):
    """Free space fell below the --min-free-gb floor; the conversion stopped cleanly and can be resumed."""


# --- recipe -------------------------------------------------------------------------------------------------------


def make_recipe(overrides: dict[str, str] | None = None) -> dict[str, str]:
    """The default recipe with `overrides` applied, validated."""
    recipe = dict(DEFAULT_RECIPE)
    for cls, enc in (overrides or {}).items():
        if cls not in TENSOR_CLASSES:
            raise ConversionError(f"unknown tensor class {cls!r}; classes: {', '.join(TENSOR_CLASSES)}")
        if enc not in Encoding.ALL:
            raise ConversionError(f"unknown encoding {enc!r} for {cls}; encodings: {', '.join(Encoding.ALL)}")
        if cls in UNQUANTIZABLE_CLASSES and enc in Encoding.QUANTIZED:
            raise ConversionError(f"{cls} tensors must not be quantized (asked for {enc}); use f32, f16 or bf16")
        recipe[cls] = enc
    return recipe


# --- small file helpers -------------------------------------------------------------------------------------------


def _atomic_json(path: Path, obj) -> None:
    tmp = path.with_name(path.name + ".partial")
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def free_bytes(path: Path) -> int:
    """Free bytes on the filesystem of `path` (tests monkeypatch this)."""
    return shutil.disk_usage(path).free


def _crash_point(label: str) -> None:
    if os.environ.get(CRASH_ENV) == label:
        os.kill(os.getpid(), signal.SIGKILL)


def _flatten(d: dict, prefix: str = "") -> dict[str, object]:
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flatten(v, key + "."))
        else:
            out[key] = v
    return out


# --- progress and summary -----------------------------------------------------------------------------------------


class ProgressSink:
    """Receives progress events; the CLI draws bars from them. The default does nothing."""

    def start(self, units: list[tuple[str, int | None]], done: int) -> None: ...

    def unit_start(self, name: str, nbytes: int, ntensors: int) -> None: ...

    def tensor_done(self, nbytes: int) -> None: ...

    def unit_done(self, name: str, nbytes: int) -> None: ...

    def finalizing(self) -> None: ...


@dataclass
class ClassStats:
    tensors: int = 0
    worst_relative_rmse: float = 0.0
    worst_tensor: str = ""
    source_bytes: int = 0
    stored_bytes: int = 0

    def add(self, name: str, rmse: float, source_bytes: int, stored_bytes: int) -> None:
        self.tensors += 1
        self.source_bytes += source_bytes
        self.stored_bytes += stored_bytes
        if rmse > self.worst_relative_rmse or not self.worst_tensor:
            self.worst_relative_rmse, self.worst_tensor = rmse, name

    def merge(self, other: ClassStats) -> None:
        self.tensors += other.tensors
        self.source_bytes += other.source_bytes
        self.stored_bytes += other.stored_bytes
        if other.worst_relative_rmse > self.worst_relative_rmse or not self.worst_tensor:
            self.worst_relative_rmse, self.worst_tensor = other.worst_relative_rmse, other.worst_tensor

    def to_json(self) -> dict:
        return {"tensors": self.tensors, "worst_relative_rmse": self.worst_relative_rmse,
                "worst_tensor": self.worst_tensor, "source_bytes": self.source_bytes, "stored_bytes": self.stored_bytes}

    @classmethod
    def from_json(cls, d: dict) -> ClassStats:
        return cls(int(d["tensors"]), float(d["worst_relative_rmse"]), str(d["worst_tensor"]),
                   int(d["source_bytes"]), int(d["stored_bytes"]))


@dataclass(frozen=True)
class ConversionSummary:
    out_dir: Path
    family: str
    units: int
    units_resumed: int
    source_bytes_read: int  # bytes of source shards processed in this run
    container_bytes: int
    seconds: float
    quant: dict[str, dict]
    mtp_layers: tuple[int, ...]

    @property
    def throughput_gbps(self) -> float:
        return self.source_bytes_read / 1e9 / self.seconds if self.seconds > 0 else 0.0


# --- per-unit state -----------------------------------------------------------------------------------------------


@dataclass
class UnitState:
    index: int
    shard: str
    shard_sha256: str
    shard_size: int
    files: dict[str, list[FileInfo]]  # role -> files in the parts folder
    entries: list[IndexEntry]
    tensors: list[str]
    pending_file: str | None
    pending: list[str]
    consumed: list[str]
    stats: dict[str, ClassStats]
    dtypes: list[str]

    def to_json(self) -> dict:
        return {
            "index": self.index, "shard": self.shard, "shard_sha256": self.shard_sha256,
            "shard_size": self.shard_size,
            "files": {role: [f.to_json() for f in infos] for role, infos in self.files.items()},
            "entries": [e.to_json() for e in self.entries], "tensors": self.tensors,
            "pending_file": self.pending_file, "pending": self.pending, "consumed": self.consumed,
            "stats": {k: v.to_json() for k, v in self.stats.items()}, "dtypes": self.dtypes,
        }

    @classmethod
    def from_json(cls, d: dict) -> UnitState:
        return cls(
            int(d["index"]), str(d["shard"]), str(d["shard_sha256"]), int(d["shard_size"]),
            {role: [FileInfo.from_json(f) for f in infos] for role, infos in d["files"].items()},
            [IndexEntry.from_json(e) for e in d["entries"]], list(d["tensors"]), d["pending_file"],
            list(d["pending"]), list(d["consumed"]),
            {k: ClassStats.from_json(v) for k, v in d["stats"].items()}, list(d["dtypes"]),
        )


PENDING_KEY = "colibri.pending"


class PendingPool:
    """Encoded expert parts and raw FP8 pieces waiting for siblings that live in a later shard."""

    def __init__(self):
        self.parts: dict[tuple[int, int, str], QuantizedTensor] = {}
        self.raw: dict[str, tuple[str, np.ndarray]] = {}  # source name -> (safetensors dtype, array)

    @staticmethod
    def part_key(layer: int, expert: int, part: str) -> str:
        return f"part.{layer}.{expert}.{part}"

    def keys(self) -> list[str]:
        return sorted([self.part_key(*k) for k in self.parts] + [f"raw.{n}" for n in self.raw])

    def load(self, path: Path, keys: set[str]) -> None:
        sf = SafetensorsFile(path)
        try:
            meta = json.loads(sf.header.metadata[PENDING_KEY])
            for key, desc in meta.items():
                if key not in keys:
                    continue
                if desc["kind"] == "part":
                    scales = np.array(sf.array(key + ".scales")) if key + ".scales" in sf.header.tensors else None
                    data = np.array(sf.array(key + ".data"))
                    _, layer, expert, part = key.split(".")
                    self.parts[(int(layer), int(expert), part)] = QuantizedTensor(
                        desc["encoding"], tuple(desc["shape"]), data, scales)
                else:
                    self.raw[key[len("raw."):]] = (desc["dtype"], np.array(sf.array(key)))
        finally:
            sf.close()

    def save(self, path: Path) -> None:
        arrays, meta = [], {}
        for (layer, expert, part), qt in sorted(self.parts.items()):
            key = self.part_key(layer, expert, part)
            meta[key] = {"kind": "part", "encoding": qt.encoding, "shape": list(qt.shape)}
            data = np.ascontiguousarray(qt.data)
            arrays.append((key + ".data", NUMPY_TO_DTYPE[data.dtype], data))
            if qt.scales is not None:
                arrays.append((key + ".scales", "F16", np.ascontiguousarray(qt.scales)))
        for name, (dtype, array) in sorted(self.raw.items()):
            meta[f"raw.{name}"] = {"kind": "raw", "dtype": dtype}
            arrays.append((f"raw.{name}", dtype, np.ascontiguousarray(array, dtype=DTYPES[dtype])))
        write_arrays(path, arrays, {PENDING_KEY: json.dumps(meta, sort_keys=True)})


# --- the converter ------------------------------------------------------------------------------------------------


@dataclass
class _UnitWork:
    resident: dict[str, QuantizedTensor] = field(default_factory=dict)
    mtp: dict[str, QuantizedTensor] = field(default_factory=dict)
    stats: dict[str, ClassStats] = field(default_factory=dict)
    dtypes: set[str] = field(default_factory=set)


class _ExpertSink:
    """Writes a unit's expert records in (layer, expert) order as soon as each one and all before it are encoded."""

    def __init__(self, path: Path, expected: list[tuple[int, int]], pool: PendingPool):
        self.expected = expected
        self.pool = pool
        self.entries: list[IndexEntry] = []
        self._next = 0
        self._writer = ExpertFileWriter(path)

    def flush(self) -> None:
        parts = self.pool.parts
        while self._next < len(self.expected):
            layer, expert = self.expected[self._next]
            if not all((layer, expert, p) in parts for p in PARTS):
                return
            gate, up, down = (parts.pop((layer, expert, p)) for p in PARTS)
            self.entries.append(self._writer.append(layer, expert, gate, up, down))
            self._next += 1

    def close(self) -> FileInfo:
        self.flush()
        if self._next != len(self.expected):
            layer, expert = self.expected[self._next]
            raise ConversionError(f"internal: expert {expert} of layer {layer} was expected in this unit but not made")
        return self._writer.close()

    def abort(self) -> None:
        self._writer.abort()


class _Jobs:
    """Encodings running on the encoder threads, placed in submission order, and every tensor's error record."""

    def __init__(self, executor: ThreadPoolExecutor, sink: _ExpertSink | None, limit: int):
        self.executor = executor
        self.sink = sink
        self.limit = limit  # encodings in flight; each holds a view of a read batch
        self.inflight: deque = deque()
        self.records: list[tuple] = []

    def submit(self, key: tuple, label: str, tensor_class: str, raw: np.ndarray, encoding: str, place) -> None:
        future = self.executor.submit(encode_bf16, raw, encoding)
        self.inflight.append((future, key, label, tensor_class, raw.size * 4, place))
        while len(self.inflight) > self.limit:
            self._finish_oldest()

    def _finish_oldest(self) -> None:
        future, key, label, tensor_class, source_bytes, place = self.inflight.popleft()
        qt, rmse = future.result()
        self.done(key, label, tensor_class, rmse, source_bytes, qt, place)

    def done(self, key: tuple, label: str, tensor_class: str, rmse: float, source_bytes: int, qt: QuantizedTensor,
             place) -> None:
        self.records.append((key, tensor_class, label, rmse, source_bytes, qt.nbytes))
        place(qt)
        if self.sink is not None:
            self.sink.flush()

    def drain(self) -> None:
        while self.inflight:
            self._finish_oldest()

    def cancel(self) -> None:
        for future, *_ in self.inflight:
            future.cancel()
        for future, *_ in self.inflight:
            if not future.cancelled():
                future.exception()  # wait: a running encoding must not outlive its source buffer's owner
        self.inflight.clear()


class Converter:
    def __init__(self, source: Source, out_dir: Path, recipe: dict[str, str] | None = None, *,
                 min_free_gb: float = 0.0, restart: bool = False, progress: ProgressSink | None = None,
                 workers: int | None = None):
        self.source = source
        self.workers = max(1, workers or min(4, os.cpu_count() or 1))
        self._executor: ThreadPoolExecutor | None = None
        self.out_dir = Path(out_dir)
        self.recipe = make_recipe(recipe)
        self.min_free_bytes = int(min_free_gb * GB)
        self.restart = restart
        self.progress = progress or ProgressSink()
        self.state_dir = self.out_dir / STATE_DIR
        self.parts_dir = self.state_dir / "parts"
        self.units_dir = self.state_dir / "units"
        self._lock_file = None

    # --- guards ---

    def _lock(self) -> None:
        self.out_dir.mkdir(parents=True, exist_ok=True)
        f = open(self.out_dir / LOCK_NAME, "a+")  # noqa: SIM115 - held for the whole conversion
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.close()
            raise ConversionError(
                f"another colibri-convert is writing {self.out_dir}; wait for it to finish or stop it first"
            ) from None
        self._lock_file = f

    def _unlock(self, remove: bool) -> None:
        if self._lock_file is not None:
            if remove:
                (self.out_dir / LOCK_NAME).unlink(missing_ok=True)
            fcntl.flock(self._lock_file.fileno(), fcntl.LOCK_UN)
            self._lock_file.close()
            self._lock_file = None

    def _clean_output(self) -> None:
        """--restart: remove the resume state and every file a conversion writes, manifest first."""
        (self.out_dir / MANIFEST_NAME).unlink(missing_ok=True)
        shutil.rmtree(self.state_dir, ignore_errors=True)
        for p in self.out_dir.iterdir():
            name = p.name
            ours = (name in VERBATIM_FILES or name == EXPERT_INDEX_NAME or name.endswith(".partial")
                    or name.startswith(("resident-", "mtp-", "experts-")))
            if ours and p.is_file():
                p.unlink()

    def _check_params(self, params: dict) -> None:
        path = self.state_dir / "params.json"
        if path.is_file():
            try:
                old = json.loads(path.read_text())
            except json.JSONDecodeError:
                old = None
            if old is not None and old != params:
                a, b = _flatten(old), _flatten(params)
                diffs = [f"{k}: {a.get(k)!r} -> {b.get(k)!r}" for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]
                raise ConversionError(
                    f"{self.out_dir} holds a partial conversion with different parameters ({'; '.join(diffs)}); "
                    "rerun with the original parameters to resume, or add --restart to start over"
                )
            if old is not None:
                return
        self.state_dir.mkdir(parents=True, exist_ok=True)
        _atomic_json(path, params)

    # --- main entry ---

    def run(self) -> ConversionSummary:
        self._lock()
        finished = False
        try:
            warm_up()
            with ThreadPoolExecutor(self.workers, thread_name_prefix="colibri-encode") as self._executor:
                summary = self._run_locked()
            finished = True
            return summary
        finally:
            self._executor = None
            self._unlock(remove=finished)

    def _run_locked(self) -> ConversionSummary:
        t0 = time.monotonic()
        if self.restart:
            self._clean_output()
        if (self.out_dir / MANIFEST_NAME).is_file() and not self.state_dir.exists():
            raise ConversionError(
                f"{self.out_dir} already holds a finished container; add --restart to convert again into it"
            )
        config = self.source.config()
        plan = plan_for(config)
        self.plan = plan
        params = {
            "converter_version": CONVERTER_VERSION,
            "family": plan.family,
            "recipe": self.recipe,
            "source": self.source.identity(),
        }
        self._check_params(params)
        self.units_dir.mkdir(parents=True, exist_ok=True)
        self.parts_dir.mkdir(parents=True, exist_ok=True)
        shards = self.source.shards()
        weight_map = self.source.weight_map()
        if weight_map is not None:
            self._check_names(weight_map)
        states: list[UnitState] = []
        resumed = 0
        read_bytes = 0
        self.progress.start([(s.name, s.size) for s in shards],
                            sum(1 for i in range(len(shards)) if self._unit_path(i).is_file()))
        for i, shard in enumerate(shards):
            state = self._load_unit(i, shard.name)
            if state is not None:
                states.append(state)
                resumed += 1
                continue
            self._check_free_space(shard.size if self.source.kind != "local" else 0)
            state = self._convert_unit(i, shard.name, states)
            read_bytes += state.shard_size
            states.append(state)
            _crash_point(f"unit{i}:committed")
        self.progress.finalizing()
        container_bytes = self._finalize(config, plan, states)
        shutil.rmtree(self.state_dir, ignore_errors=True)
        quant = self._merged_stats(states)
        return ConversionSummary(self.out_dir, plan.family, len(shards), resumed, read_bytes, container_bytes,
                                 time.monotonic() - t0, {k: v.to_json() for k, v in quant.items()},
                                 self._present_mtp_layers(plan, states))

    def _unit_path(self, i: int) -> Path:
        return self.units_dir / f"{i:05d}.json"

    def _load_unit(self, i: int, shard: str) -> UnitState | None:
        path = self._unit_path(i)
        if not path.is_file():
            return None
        try:
            state = UnitState.from_json(json.loads(path.read_text()))
        except (json.JSONDecodeError, KeyError, TypeError, ValueError):
            path.unlink()  # a corrupt state file is no commit: redo the unit
            return None
        if state.shard != shard:
            raise ConversionError(f"resume state of unit {i} names shard {state.shard}, the source has {shard}; "
                                  "the source changed: add --restart to start over")
        return state

    def _check_free_space(self, download_bytes: int) -> None:
        if not self.min_free_bytes:
            return
        free = free_bytes(self.out_dir)
        if free - download_bytes < self.min_free_bytes:
            raise DiskFloorReached(
                f"stopped before the disk fills: {free / GB:.2f} GB free on {self.out_dir}, the floor is "
                f"{self.min_free_bytes / GB:.2f} GB (plus {download_bytes / GB:.2f} GB for the next shard); free some "
                "space and run the same command again to resume"
            )

    def _check_names(self, names) -> None:
        unknown = [n for n in sorted(names) if not n.endswith(SCALE_SUFFIX) and resolve(self.plan, n) is None]
        if unknown:
            raise ConversionError(_leftover_message(self.plan.family, unknown))

    # --- one unit ---

    def _pending_pool(self, states: list[UnitState]) -> PendingPool:
        consumed = {k for s in states for k in s.consumed}
        pool = PendingPool()
        for s in states:
            keys = set(s.pending) - consumed
            if s.pending_file and keys:
                pool.load(self.state_dir / s.pending_file, keys)
        return pool

    def _convert_unit(self, i: int, shard: str, states: list[UnitState]) -> UnitState:
        pool = self._pending_pool(states)
        before = set(pool.keys())
        scratch = self.state_dir / "download"
        files: dict[str, list[FileInfo]] = {}
        with self.source.open_shard(shard, scratch) as path:
            shard_size = path.stat().st_size
            sf = SafetensorsFile(path)
            reader = ShardReader(path, sf.header)
            try:
                expected = self._experts_completed_by(sf, pool)
                sink = _ExpertSink(self.parts_dir / f"experts-u{i:05d}.colx", expected, pool) if expected else None
                try:
                    work = self._convert_tensors(sf, reader, pool, shard, sink)
                    if sink is not None:
                        files["experts"] = [sink.close()]
                except BaseException:
                    if sink is not None:
                        sink.abort()
                    raise
                sha = reader.sha256()
            finally:
                reader.close()
                sf.close()
        if work.resident:
            files["resident"] = [write_safetensors(self.parts_dir / f"resident-u{i:05d}.safetensors", work.resident)]
        if work.mtp:
            files["mtp"] = [write_safetensors(self.parts_dir / f"mtp-u{i:05d}.safetensors", work.mtp)]
        files = {role: files[role] for role in ("resident", "mtp", "experts") if role in files}
        entries: list[IndexEntry] = sink.entries if sink is not None else []
        after = set(pool.keys())
        pending_file = None
        if after - before:
            pending_file = f"pending-{i:05d}.safetensors"
            new_pool = PendingPool()
            new_pool.parts = {k: v for k, v in pool.parts.items() if PendingPool.part_key(*k) in after - before}
            new_pool.raw = {k: v for k, v in pool.raw.items() if f"raw.{k}" in after - before}
            new_pool.save(self.state_dir / pending_file)
        _crash_point(f"unit{i}:files")
        state = UnitState(i, shard, sha, shard_size, files, entries,
                          sorted(list(work.resident) + list(work.mtp)), pending_file, sorted(after - before),
                          sorted(before - after), work.stats, sorted(work.dtypes))
        _atomic_json(self._unit_path(i), state.to_json())
        self.progress.unit_done(shard, shard_size)
        return state

    def _encoding(self, tensor_class: str) -> str:
        return self.recipe[tensor_class]

    def _experts_completed_by(self, sf: SafetensorsFile, pool: PendingPool) -> list[tuple[int, int]]:
        """The experts whose three parts this unit will hold once its tensors are encoded, in record order.

        Mirrors the decisions of `_convert_tensors` (an FP8 weight without its scale waits for a later unit)."""
        tensors = sf.header.tensors
        parts = set(pool.parts)
        for name in sf.names:
            if name.endswith(SCALE_SUFFIX):
                base = name[: -len(SCALE_SUFFIX)]
                if base in tensors or base not in pool.raw:
                    continue
                dtype = pool.raw[base][0]
                name = base
            else:
                dtype = tensors[name].dtype
                if dtype in FP8_DTYPES and name + SCALE_SUFFIX not in tensors and name + SCALE_SUFFIX not in pool.raw:
                    continue
            kind = resolve(self.plan, name)
            if isinstance(kind, ExpertPart):
                parts.add((kind.layer, kind.expert, kind.part))
            elif isinstance(kind, FusedExperts):
                which = ("gate", "up") if kind.which == "gate_up" else ("down",)
                parts.update((kind.layer, x, p) for x in range(self.plan.expert_layers[kind.layer].num_experts)
                             for p in which)
        return sorted({(layer, x) for (layer, x, _) in parts if all((layer, x, p) in parts for p in PARTS)})

    def _convert_tensors(self, sf: SafetensorsFile, reader: ShardReader, pool: PendingPool, shard: str,
                         sink: _ExpertSink | None) -> _UnitWork:
        """Encode every tensor of the shard, in file order, on the encoder threads; returns the resident ones."""
        names = sf.names
        self._check_names(names)
        in_shard = set(names)
        position = {n: k for k, n in enumerate(names)}
        work = _UnitWork()
        jobs = _Jobs(self._executor, sink, limit=2 * self.workers + 2)
        self.progress.unit_start(shard, sum(e.end - e.begin for e in sf.header.tensors.values()), len(names))

        def raw_of(name: str, streamed: np.ndarray | None = None) -> tuple[str, np.ndarray] | None:
            if name in in_shard:
                return sf.header.tensors[name].dtype, (streamed if streamed is not None else sf.array(name))
            return pool.raw.pop(name, None)

        try:
            for entry, array in reader:
                name = entry.name
                nbytes = entry.end - entry.begin
                key = position[name]
                streamed = array
                if name.endswith(SCALE_SUFFIX):
                    base = name[: -len(SCALE_SUFFIX)]
                    if base in in_shard:
                        self.progress.tensor_done(nbytes)
                        continue  # consumed with its weight
                    if base not in pool.raw:
                        pool.raw[name] = (entry.dtype, np.array(array))  # weight comes in a later shard
                        self.progress.tensor_done(nbytes)
                        continue
                    name, streamed = base, None  # the weight arrived earlier and waited for this scale
                kind = resolve(self.plan, name)
                dtype, raw = raw_of(name, streamed)
                work.dtypes.add(dtype)
                scale = None
                if dtype in FP8_DTYPES:
                    scale_entry = raw_of(name + SCALE_SUFFIX)
                    if scale_entry is None:
                        pool.raw[name] = (dtype, np.array(raw))  # its scale comes in a later shard
                        self.progress.tensor_done(nbytes)
                        continue
                    scale = to_f32(scale_entry[1], scale_entry[0], name + SCALE_SUFFIX)
                if isinstance(kind, Resident):
                    self._resident(key, name, kind, dtype, raw, scale, work, jobs)
                elif isinstance(kind, ExpertPart):
                    self._expert_part(key, name, kind, dtype, raw, scale, pool, jobs)
                elif isinstance(kind, FusedExperts):
                    self._fused(key, name, kind, dtype, raw, scale, pool, jobs)
                self.progress.tensor_done(nbytes)
            jobs.drain()
        finally:
            jobs.cancel()
        for _, cls, label, rmse, source_bytes, stored_bytes in sorted(jobs.records):
            work.stats.setdefault(cls, ClassStats()).add(label, rmse, source_bytes, stored_bytes)
        return work

    def _encode(self, key: tuple, label: str, tensor_class: str, dtype: str, raw: np.ndarray,
                scale: np.ndarray | None, jobs: _Jobs, place) -> None:
        """Encode one 2D-or-more source array with the recipe; `place(qt)` receives the result, maybe later."""
        encoding = self._encoding(tensor_class)
        if dtype == "BF16" and scale is None and encoding in FAST_ENCODINGS:
            jobs.submit(key, label, tensor_class, raw, encoding, place)
            return
        value = self._value(label, dtype, raw, scale)
        qt = quantize(value, encoding)
        jobs.done(key, label, tensor_class, relative_error(value, qt), value.size * 4, qt, place)

    @staticmethod
    def _value(name: str, dtype: str, raw: np.ndarray, scale: np.ndarray | None) -> np.ndarray:
        return fp8_to_f32(raw, scale, name) if scale is not None else to_f32(raw, dtype, name)

    def _resident(self, key, name, kind: Resident, dtype, raw, scale, work: _UnitWork, jobs: _Jobs) -> None:
        if tuple(raw.shape) != kind.spec.shape:
            raise ConversionError(
                f"tensor {name} has shape {list(raw.shape)}, config.json implies {list(kind.spec.shape)}; the "
                "checkpoint and its config disagree"
            )
        target = work.mtp if kind.spec.group == MTP else work.resident
        self._encode((key, 0), kind.name, kind.spec.tensor_class, dtype, raw, scale, jobs,
                     lambda qt, n=kind.name: target.__setitem__(n, qt))

    def _expert_part(self, key, name, kind: ExpertPart, dtype, raw, scale, pool: PendingPool, jobs: _Jobs) -> None:
        want = self.plan.expert_shapes[kind.part]
        if tuple(raw.shape) != tuple(want):
            raise ConversionError(
                f"expert tensor {name} has shape {list(raw.shape)}, config.json implies {list(want)}"
            )
        slot = (kind.layer, kind.expert, kind.part)
        self._encode((key, 0), name, kind.tensor_class, dtype, raw, scale, jobs,
                     lambda qt: pool.parts.__setitem__(slot, qt))

    def _fused(self, key, name, kind: FusedExperts, dtype, raw, scale, pool: PendingPool, jobs: _Jobs) -> None:
        e = self.plan.expert_layers[kind.layer].num_experts
        inter, hidden = self.plan.expert_shapes["gate"]
        want = (e, 2 * inter, hidden) if kind.which == "gate_up" else (e, hidden, inter)
        if tuple(raw.shape) != want:
            raise ConversionError(f"fused expert tensor {name} has shape {list(raw.shape)}, config.json implies "
                                  f"{list(want)}")

        def placer(slot):
            return lambda qt: pool.parts.__setitem__(slot, qt)

        for x in range(e):
            x_scale = None if scale is None else scale[x]
            if kind.which == "gate_up":
                piece_dtype = dtype
                if dtype == "BF16" and x_scale is None:
                    pieces = (("gate", raw[x][:inter]), ("up", raw[x][inter:]))
                else:  # one float32 slice per expert, split in two
                    value = self._value(f"{name}[{x}]", dtype, raw[x], x_scale)
                    pieces = (("gate", np.ascontiguousarray(value[:inter])),
                              ("up", np.ascontiguousarray(value[inter:])))
                    piece_dtype = "F32"
                for k, (part, rows) in enumerate(pieces):
                    self._encode((key, 2 * x + k), f"{name}[{x}].{part}", kind.tensor_class, piece_dtype, rows,
                                 None, jobs, placer((kind.layer, x, part)))
            else:
                self._encode((key, 2 * x), f"{name}[{x}]", kind.tensor_class, dtype, raw[x], x_scale, jobs,
                             placer((kind.layer, x, "down")))

    # --- completion and finalization ---

    def _present_mtp_layers(self, plan: ModelPlan, states: list[UnitState]) -> tuple[int, ...]:
        produced = {t for s in states for t in s.tensors}
        return tuple(n for n in plan.mtp_layers if any(t.startswith(f"model.layers.{n}.") for t in produced)
                     or any(e.layer == n for s in states for e in s.entries))

    def _check_complete(self, plan: ModelPlan, states: list[UnitState]) -> None:
        produced = {t for s in states for t in s.tensors}
        have_mtp = set(self._present_mtp_layers(plan, states))
        absent_mtp = {f"model.layers.{n}." for n in plan.mtp_layers if n not in have_mtp}
        missing = [n for n in plan.tensors if n not in produced and not n.startswith(tuple(absent_mtp))]
        records = {(e.layer, e.expert) for s in states for e in s.entries}
        for layer, el in sorted(plan.expert_layers.items()):
            if f"model.layers.{layer}." in absent_mtp:
                continue
            missing += [f"{el.prefix}.{x} (expert {x} of layer {layer})" for x in range(el.num_experts)
                        if (layer, x) not in records]
        leftovers = [k for s in states for k in s.pending]
        consumed = {k for s in states for k in s.consumed}
        stranded = sorted(set(leftovers) - consumed)
        if missing or stranded:
            parts = []
            if missing:
                parts.append(f"{len(missing)} missing: {', '.join(sorted(missing)[:12])}")
            if stranded:
                parts.append(f"{len(stranded)} incomplete (sibling never found): {', '.join(stranded[:12])}")
            raise ConversionError(f"the checkpoint is incomplete for {plan.family}: {'; '.join(parts)}")

    def _final_names(self, states: list[UnitState]) -> dict[str, str]:
        patterns = {"resident": RESIDENT_FILE_PATTERN, "mtp": MTP_FILE_PATTERN, "experts": EXPERT_FILE_PATTERN}
        counters = {role: 0 for role in patterns}
        mapping = {}
        for s in states:
            for role in ("resident", "mtp", "experts"):
                for info in s.files.get(role, []):
                    counters[role] += 1
                    mapping[info.name] = patterns[role].format(counters[role])
        return mapping

    def _finalize(self, config: dict, plan: ModelPlan, states: list[UnitState]) -> int:
        self._check_complete(plan, states)
        mapping = self._final_names(states)
        files: dict[str, list[FileInfo]] = {"resident": [], "mtp": [], "experts": [], "verbatim": []}
        for s in states:
            for role, infos in s.files.items():
                for info in infos:
                    final = mapping[info.name]
                    src, dst = self.parts_dir / info.name, self.out_dir / final
                    if src.is_file():
                        os.replace(src, dst)
                    elif not (dst.is_file() and dst.stat().st_size == info.size):
                        raise ConversionError(f"unit file {info.name} vanished from {self.parts_dir}; add --restart")
                    files[role].append(FileInfo(final, info.size, info.sha256))
        _crash_point("finalize:renamed")
        entries = [IndexEntry(e.layer, e.expert, mapping[e.file], e.offset, e.length, e.crc32, e.encodings)
                   for s in states for e in s.entries]
        source_files = {s.shard: s.shard_sha256 for s in states}
        import hashlib

        for name, data in sorted(self.source.verbatim_files().items()):
            files["verbatim"].append(write_verbatim(self.out_dir, name, data))
            source_files[name] = hashlib.sha256(data).hexdigest()
        source = dict(self.source.manifest_source())
        source["files"] = dict(sorted(source_files.items()))
        quant = self._merged_stats(states)
        mtp_layers = self._present_mtp_layers(plan, states)
        extra = {
            "converter": {"name": "colibri-convert", "version": CONVERTER_VERSION},
            "quantization": {k: {"tensors": v.tensors, "worst_relative_rmse": v.worst_relative_rmse,
                                 "worst_tensor": v.worst_tensor} for k, v in sorted(quant.items())},
            "mtp": {"layers": list(mtp_layers), "encoding": self.recipe["mtp"],
                    "experts_in_records": True},
            "source_dtypes": sorted({d for s in states for d in s.dtypes}),
            "num_hidden_layers": int(config["num_hidden_layers"]),
        }
        num_experts = max((el.num_experts for el in plan.expert_layers.values()), default=0)
        finalize_container(self.out_dir, family=plan.family, source=source, recipe=self.recipe,
                           files={k: v for k, v in files.items() if v}, index_entries=entries,
                           expert_shapes={k: list(v) for k, v in plan.expert_shapes.items()},
                           num_experts=num_experts, extra_manifest=extra)
        _crash_point("finalize:done")
        manifest = json.loads((self.out_dir / MANIFEST_NAME).read_text())
        return sum(f["size"] for f in manifest["files"].values()) + (self.out_dir / MANIFEST_NAME).stat().st_size

    @staticmethod
    def _merged_stats(states: list[UnitState]) -> dict[str, ClassStats]:
        out: dict[str, ClassStats] = {}
        for s in states:
            for k, v in s.stats.items():
                out.setdefault(k, ClassStats()).merge(v)
        return dict(sorted(out.items()))


def _leftover_message(family: str, names: list[str]) -> str:
    shown = ", ".join(names[:12]) + (f" and {len(names) - 12} more" if len(names) > 12 else "")
    return (f"{len(names)} source tensor(s) that no {family} mapping consumes: {shown}; the checkpoint does not "
            "match its config.json or this family needs support for them")


def convert(source: Source, out_dir: Path, recipe: dict[str, str] | None = None, *, min_free_gb: float = 0.0,
            restart: bool = False, progress: ProgressSink | None = None,
            workers: int | None = None) -> ConversionSummary:
    """Convert `source` into a container at `out_dir`, resuming a previous run with the same parameters.

    `workers` encoder threads (default: the CPU count, at most 4) encode while a reader thread reads ahead."""
    if isinstance(source, Source) and getattr(source, "scratch", "n/a") is None:
        source.scratch = Path(out_dir) / STATE_DIR / "download"
    return Converter(source, out_dir, recipe, min_free_gb=min_free_gb, restart=restart, progress=progress,
                     workers=workers).run()


__all__ = [
    "ColibriError",
    "ConversionSummary",
    "Converter",
    "DiskFloorReached",
    "ProgressSink",
    "convert",
    "free_bytes",
    "make_recipe",
]
