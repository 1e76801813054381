"""Writing containers: expert data files, resident safetensors files, the expert index and the manifest.

Two levels:
- `ContainerWriter`, a state machine for writing a whole container in one process: it builds everything in a
  temporary directory beside the target and renames it into place only in `finish()`, so a crash never leaves
  something that looks like a valid container.
- The pieces it is made of (`ExpertFileWriter`, `write_safetensors`, `finalize_container`), each of which writes one
  complete file atomically; the resumable converter uses them unit by unit and finalizes once every unit is done.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .constants import (
    DEFAULT_SHARD_BYTES,
    EXPERT_FILE_PATTERN,
    EXPERT_INDEX_NAME,
    EXPERT_PARTS,
    FORMAT_NAME,
    FORMAT_VERSION,
    MANIFEST_NAME,
    MTP_FILE_PATTERN,
    RECORD_ALIGNMENT,
    RESIDENT_FILE_PATTERN,
    SAFETENSORS_ENCODINGS_KEY,
    SCALES_SUFFIX,
)
from .errors import FormatError, WriterStateError
from .names import check_file_name
from .quant import QuantizedTensor, stored_layout
from .records import expert_file_header, record_chunks, round_up
from .safetensors_io import NUMPY_TO_DTYPE, FileInfo, write_arrays

WRITER_NAME = "colibri-format"


@dataclass(frozen=True)
class IndexEntry:
    """One row of the expert index: where the record of (layer, expert) lives and how to check it."""

    layer: int
    expert: int
    file: str
    offset: int
    length: int
    crc32: int
    encodings: tuple[str, str, str]

    def to_json(self) -> dict:
        return {
            "layer": self.layer,
            "expert": self.expert,
            "file": self.file,
            "offset": self.offset,
            "length": self.length,
            "crc32": self.crc32,
            "encodings": list(self.encodings),
        }

    @classmethod
    def from_json(cls, d: dict) -> IndexEntry:
        return cls(
            int(d["layer"]),
            int(d["expert"]),
            str(d["file"]),
            int(d["offset"]),
            int(d["length"]),
            int(d["crc32"]),
            tuple(str(e) for e in d["encodings"]),
        )


class ExpertFileWriter:
    """Appends expert records to one data file, written under a temporary name until `close()`."""

    def __init__(self, path: Path):
        self.path = Path(path)
        check_file_name(self.path.name)
        self._tmp = self.path.with_name(self.path.name + ".partial")
        self._file = open(self._tmp, "wb")  # noqa: SIM115 - written across append() calls
        self._hash = hashlib.sha256()
        self._size = 0
        self._closed = False
        self._write(expert_file_header())

    def _write(self, data: bytes) -> None:
        self._file.write(data)
        self._hash.update(data)
        self._size += len(data)

    @property
    def size(self) -> int:
        return self._size

    def append(
        self, layer: int, expert: int, gate: QuantizedTensor, up: QuantizedTensor, down: QuantizedTensor
    ) -> IndexEntry:
        if self._closed:
            raise WriterStateError(f"{self.path.name}: append() after close()")
        chunks, layout = record_chunks({"gate": gate, "up": up, "down": down})
        offset = self._size
        crc = 0
        for chunk in chunks:  # written straight from the arrays: no assembled copy of the record
            self._write(chunk)
            crc = zlib.crc32(chunk, crc)
        self._write(bytes(round_up(layout.length, RECORD_ALIGNMENT) - layout.length))
        encodings = tuple(p.encoding for p in layout.parts)
        return IndexEntry(int(layer), int(expert), self.path.name, offset, layout.length, crc & 0xFFFFFFFF, encodings)

    def close(self) -> FileInfo:
        if self._closed:
            raise WriterStateError(f"{self.path.name}: close() called twice")
        self._closed = True
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        os.replace(self._tmp, self.path)
        return FileInfo(self.path.name, self._size, self._hash.hexdigest())

    def abort(self) -> None:
        if not self._closed:
            self._closed = True
            self._file.close()
            self._tmp.unlink(missing_ok=True)


def stored_arrays(name: str, t: QuantizedTensor) -> list[tuple[str, str, np.ndarray]]:
    """The safetensors (name, dtype, array) triples that store one encoded tensor."""
    layout = stored_layout(t.encoding, t.shape)
    arrays = (t.data,) if t.scales is None else (t.data, t.scales)
    out = []
    for (dtype, shape), array, stored_name in zip(layout, arrays, (name, name + SCALES_SUFFIX)):
        a = np.ascontiguousarray(array)
        if a.dtype != np.dtype(dtype) or tuple(a.shape) != tuple(shape):
            raise FormatError(f"tensor {name!r}: stored array {a.dtype}{a.shape} does not match {dtype}{shape}")
        st_dtype = "BF16" if t.encoding == "bf16" else NUMPY_TO_DTYPE[a.dtype]
        out.append((stored_name, st_dtype, a))
    return out


def write_safetensors(path: Path, tensors: dict[str, QuantizedTensor], extra_metadata: dict | None = None) -> FileInfo:
    """Write encoded tensors to one safetensors file, with their encodings in its metadata."""
    check_file_name(Path(path).name)
    arrays = []
    encodings = {}
    for name, t in tensors.items():
        if name.endswith(SCALES_SUFFIX):
            raise FormatError(f"tensor name {name!r} ends with the reserved suffix {SCALES_SUFFIX!r}")
        arrays.extend(stored_arrays(name, t))
        encodings[name] = {"encoding": t.encoding, "shape": list(t.shape)}
    metadata = {SAFETENSORS_ENCODINGS_KEY: json.dumps(dict(sorted(encodings.items())), separators=(",", ":"))}
    metadata.update(extra_metadata or {})
    return write_arrays(Path(path), arrays, metadata)


def write_index(path: Path, entries: list[IndexEntry]) -> FileInfo:
    """Write the expert index (Arrow IPC file), rows sorted by (layer, expert)."""
    import pyarrow as pa

    rows = sorted(entries, key=lambda e: (e.layer, e.expert))
    table = pa.table(
        {
            "layer": pa.array([e.layer for e in rows], pa.int32()),
            "expert": pa.array([e.expert for e in rows], pa.int32()),
            "file": pa.array([e.file for e in rows], pa.string()),
            "offset": pa.array([e.offset for e in rows], pa.uint64()),
            "length": pa.array([e.length for e in rows], pa.uint64()),
            "crc32": pa.array([e.crc32 for e in rows], pa.uint32()),
            "gate_encoding": pa.array([e.encodings[0] for e in rows], pa.string()),
            "up_encoding": pa.array([e.encodings[1] for e in rows], pa.string()),
            "down_encoding": pa.array([e.encodings[2] for e in rows], pa.string()),
        }
    )
    path = Path(path)
    tmp = path.with_name(path.name + ".partial")
    with pa.OSFile(str(tmp), "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table)
    with open(tmp, "rb+") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)
    data = path.read_bytes()
    return FileInfo(path.name, len(data), hashlib.sha256(data).hexdigest())


def model_fingerprint(files: dict[str, dict]) -> str:
    """sha256 over the lines "NAME SHA256\\n" of every file of the container, sorted by name."""
    lines = "".join(f"{name} {files[name]['sha256']}\n" for name in sorted(files))
    return hashlib.sha256(lines.encode("utf-8")).hexdigest()


def _atomic_write_bytes(path: Path, data: bytes) -> FileInfo:
    tmp = path.with_name(path.name + ".partial")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return FileInfo(path.name, len(data), hashlib.sha256(data).hexdigest())


def write_verbatim(directory: Path, name: str, data: bytes) -> FileInfo:
    check_file_name(name)
    return _atomic_write_bytes(Path(directory) / name, data)


def finalize_container(
    directory: Path,
    *,
    family: str,
    source: dict,
    recipe: dict,
    files: dict[str, list[FileInfo]],
    index_entries: list[IndexEntry],
    expert_shapes: dict[str, list[int]],
    num_experts: int,
    extra_manifest: dict | None = None,
) -> Path:
    """Write the expert index and then the manifest, which makes `directory` a valid container.

    `files` maps a role ("resident", "mtp", "experts", "verbatim") to the files of that role already written in
    `directory`. The manifest is written last and atomically: until it exists the directory is not a container.
    """
    directory = Path(directory)
    if not any(f.name == "config.json" for f in files.get("verbatim", [])):
        raise WriterStateError("a container needs config.json among its verbatim files")
    seen = set()
    for e in index_entries:
        if (e.layer, e.expert) in seen:
            raise WriterStateError(f"expert ({e.layer}, {e.expert}) written twice")
        seen.add((e.layer, e.expert))
    index_info = write_index(directory / EXPERT_INDEX_NAME, index_entries)
    manifest_files: dict[str, dict] = {}
    for role, infos in sorted(files.items()):
        for info in infos:
            check_file_name(info.name)
            if info.name in manifest_files:
                raise WriterStateError(f"file {info.name!r} listed twice")
            manifest_files[info.name] = {"role": role, "size": info.size, "sha256": info.sha256}
    manifest_files[index_info.name] = {"role": "index", "size": index_info.size, "sha256": index_info.sha256}
    layers = sorted({e.layer for e in index_entries})
    manifest = {
        "format": FORMAT_NAME,
        "format_version": FORMAT_VERSION,
        "family": family,
        "writer": f"{WRITER_NAME} {_writer_version()}",
        "source": source,
        "recipe": dict(sorted(recipe.items())),
        "experts": {
            "layers": layers,
            "num_experts": int(num_experts),
            "records": len(index_entries),
            "parts": list(EXPERT_PARTS),
            "shapes": {k: [int(d) for d in v] for k, v in expert_shapes.items()},
        },
        "files": manifest_files,
        "fingerprint": model_fingerprint(manifest_files),
    }
    if extra_manifest:
        clash = set(extra_manifest) & set(manifest)
        if clash:
            raise WriterStateError(f"extra manifest keys clash with reserved ones: {sorted(clash)}")
        manifest["extra"] = extra_manifest
    text = json.dumps(manifest, indent=2, sort_keys=True) + "\n"
    _atomic_write_bytes(directory / MANIFEST_NAME, text.encode("utf-8"))
    return directory


def _writer_version() -> str:
    from . import __version__

    return __version__


class ContainerWriter:
    """Write a whole container: add verbatim files, tensors and experts in any order, then `finish()`.

    States: open -> finished | aborted. Any call after finish() or abort() raises WriterStateError, as do duplicate
    names, duplicate experts and experts whose shapes disagree with the first one written.
    """

    def __init__(
        self,
        out_dir: Path,
        *,
        family: str,
        config: dict,
        source: dict | None = None,
        recipe: dict | None = None,
        shard_bytes: int = DEFAULT_SHARD_BYTES,
    ):
        self.out_dir = Path(out_dir)
        if self.out_dir.exists() and any(self.out_dir.iterdir()):
            raise WriterStateError(f"{self.out_dir} exists and is not empty; choose a new directory")
        self.family = family
        self.source = source or {}
        self.recipe = recipe or {}
        self.shard_bytes = shard_bytes
        self._tmp = self.out_dir.with_name(f".{self.out_dir.name}.tmp-{os.getpid()}")
        if self._tmp.exists():
            shutil.rmtree(self._tmp)
        self._tmp.mkdir(parents=True)
        self._state = "open"
        self._verbatim: dict[str, FileInfo] = {}
        self._groups: dict[str, list[dict[str, QuantizedTensor]]] = {"resident": [{}], "mtp": [{}]}
        self._group_bytes = {"resident": 0, "mtp": 0}
        self._tensor_names: set[str] = set()
        self._expert_files: list[FileInfo] = []
        self._expert_writer: ExpertFileWriter | None = None
        self._entries: list[IndexEntry] = []
        self._expert_keys: set[tuple[int, int]] = set()
        self._expert_shapes: dict[str, list[int]] | None = None
        self._num_experts = 0
        self.add_verbatim_file("config.json", (json.dumps(config, indent=2, sort_keys=True) + "\n").encode())

    def _require_open(self, what: str) -> None:
        if self._state != "open":
            raise WriterStateError(f"{what} called on a writer that is {self._state}")

    def add_verbatim_file(self, name: str, data: bytes) -> None:
        self._require_open("add_verbatim_file()")
        self._verbatim[name] = write_verbatim(self._tmp, name, data)

    def add_tensor(self, name: str, tensor: QuantizedTensor, group: str = "resident") -> None:
        self._require_open("add_tensor()")
        if group not in self._groups:
            raise WriterStateError(f"unknown tensor group {group!r}; use 'resident' or 'mtp'")
        if name in self._tensor_names:
            raise WriterStateError(f"tensor {name!r} added twice")
        stored_arrays(name, tensor)  # validates the stored arrays now, not at finish()
        self._tensor_names.add(name)
        shards = self._groups[group]
        if shards[-1] and self._group_bytes[group] + tensor.nbytes > self.shard_bytes:
            shards.append({})
            self._group_bytes[group] = 0
        shards[-1][name] = tensor
        self._group_bytes[group] += tensor.nbytes

    def add_expert(
        self, layer: int, expert: int, *, gate: QuantizedTensor, up: QuantizedTensor, down: QuantizedTensor
    ) -> None:
        self._require_open("add_expert()")
        key = (int(layer), int(expert))
        if key in self._expert_keys:
            raise WriterStateError(f"expert {key} added twice")
        shapes = {"gate": list(gate.shape), "up": list(up.shape), "down": list(down.shape)}
        if self._expert_shapes is None:
            self._expert_shapes = shapes
        elif shapes != self._expert_shapes:
            raise WriterStateError(f"expert {key} has shapes {shapes}, expected {self._expert_shapes}")
        if self._expert_writer is None or self._expert_writer.size >= self.shard_bytes:
            self._roll_expert_file()
        self._entries.append(self._expert_writer.append(layer, expert, gate, up, down))
        self._expert_keys.add(key)
        self._num_experts = max(self._num_experts, int(expert) + 1)

    def _roll_expert_file(self) -> None:
        if self._expert_writer is not None:
            self._expert_files.append(self._expert_writer.close())
        name = EXPERT_FILE_PATTERN.format(len(self._expert_files) + 1)
        self._expert_writer = ExpertFileWriter(self._tmp / name)

    def finish(self, extra_manifest: dict | None = None) -> Path:
        self._require_open("finish()")
        try:
            if self._expert_writer is not None:
                self._expert_files.append(self._expert_writer.close())
                self._expert_writer = None
            files: dict[str, list[FileInfo]] = {"verbatim": list(self._verbatim.values()), "experts": self._expert_files}
            for group, pattern in (("resident", RESIDENT_FILE_PATTERN), ("mtp", MTP_FILE_PATTERN)):
                shards = [s for s in self._groups[group] if s]
                files[group] = [write_safetensors(self._tmp / pattern.format(i + 1), s) for i, s in enumerate(shards)]
            finalize_container(
                self._tmp,
                family=self.family,
                source=self.source,
                recipe=self.recipe,
                files=files,
                index_entries=self._entries,
                expert_shapes=self._expert_shapes or {},
                num_experts=self._num_experts,
                extra_manifest=extra_manifest,
            )
            if self.out_dir.exists():
                self.out_dir.rmdir()  # empty, checked in __init__
            os.replace(self._tmp, self.out_dir)
        except BaseException:
            self.abort()
            raise
        self._state = "finished"
        return self.out_dir

    def abort(self) -> None:
        if self._state == "open":
            if self._expert_writer is not None:
                self._expert_writer.abort()
            shutil.rmtree(self._tmp, ignore_errors=True)
            self._state = "aborted"

    def __enter__(self) -> ContainerWriter:  # noqa: PYI034
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.abort()


__all__ = [
    "ContainerWriter",
    "ExpertFileWriter",
    "IndexEntry",
    "finalize_container",
    "model_fingerprint",
    "write_index",
    "write_safetensors",
    "write_verbatim",
]
