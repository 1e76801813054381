"""A small, strict safetensors reader and writer (no torch, no safetensors package needed at run time).

The writer streams tensors in name order and hashes the bytes as it writes them. The reader refuses what the
safetensors specification forbids: headers larger than the file or than MAX_SAFETENSORS_HEADER_BYTES, duplicate
names, unknown dtypes, sizes that disagree with shapes, overlapping offsets and holes in the data buffer.
"""

from __future__ import annotations

import hashlib
import json
import math
import mmap
import os
import struct
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .constants import MAX_SAFETENSORS_HEADER_BYTES, MAX_TENSOR_RANK
from .errors import FormatError

# safetensors dtype name -> numpy dtype of the stored bytes (BF16 and FP8 are handed out as raw bits).
DTYPES = {
    "F64": np.dtype("<f8"),
    "F32": np.dtype("<f4"),
    "F16": np.dtype("<f2"),
    "BF16": np.dtype("<u2"),
    "I64": np.dtype("<i8"),
    "I32": np.dtype("<i4"),
    "I16": np.dtype("<i2"),
    "I8": np.dtype("i1"),
    "U64": np.dtype("<u8"),
    "U32": np.dtype("<u4"),
    "U16": np.dtype("<u2"),
    "U8": np.dtype("u1"),
    "BOOL": np.dtype("?"),
    "F8_E4M3": np.dtype("u1"),
    "F8_E5M2": np.dtype("u1"),
}
NUMPY_TO_DTYPE = {
    np.dtype("<f8"): "F64",
    np.dtype("<f4"): "F32",
    np.dtype("<f2"): "F16",
    np.dtype("<i8"): "I64",
    np.dtype("<i4"): "I32",
    np.dtype("<i2"): "I16",
    np.dtype("i1"): "I8",
    np.dtype("<u8"): "U64",
    np.dtype("<u4"): "U32",
    np.dtype("<u2"): "U16",
    np.dtype("u1"): "U8",
    np.dtype("?"): "BOOL",
}
_HASH_CHUNK = 16 * 1024 * 1024


@dataclass(frozen=True)
class FileInfo:
    """Name (relative to its container), size in bytes and sha256 of one written file."""

    name: str
    size: int
    sha256: str

    def to_json(self) -> dict:
        return {"name": self.name, "size": self.size, "sha256": self.sha256}

    @classmethod
    def from_json(cls, d: dict) -> FileInfo:
        return cls(str(d["name"]), int(d["size"]), str(d["sha256"]))


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of a safetensors header: dtype name, shape and absolute byte range in the file."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int


@dataclass(frozen=True)
class SafetensorsHeader:
    tensors: dict[str, TensorEntry]
    metadata: dict[str, str]
    data_start: int


def reject_duplicate_keys(pairs: list[tuple[str, object]]) -> dict:
    out: dict = {}
    for key, value in pairs:
        if key in out:
            raise FormatError(f"duplicate key {key!r} in a JSON header")
        out[key] = value
    return out


def parse_header(raw: bytes | memoryview, file_size: int, what: str) -> SafetensorsHeader:
    """Validate and parse a safetensors header from the first bytes of a file of `file_size` bytes."""
    if file_size < 8 or len(raw) < 8:
        raise FormatError(f"{what}: too short to be a safetensors file ({file_size} bytes)")
    (header_len,) = struct.unpack("<Q", bytes(raw[:8]))
    if header_len > MAX_SAFETENSORS_HEADER_BYTES:
        raise FormatError(f"{what}: safetensors header of {header_len} bytes exceeds the {MAX_SAFETENSORS_HEADER_BYTES} limit")
    if 8 + header_len > file_size:
        raise FormatError(f"{what}: safetensors header ({header_len} bytes) runs past the end of the file")
    try:
        header = json.loads(bytes(raw[8 : 8 + header_len]), object_pairs_hook=reject_duplicate_keys)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise FormatError(f"{what}: safetensors header is not valid JSON ({exc})") from None
    if not isinstance(header, dict):
        raise FormatError(f"{what}: safetensors header is not a JSON object")
    data_start = 8 + header_len
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise FormatError(f"{what}: __metadata__ must map strings to strings")
    tensors: dict[str, TensorEntry] = {}
    for name, info in header.items():
        tensors[name] = _parse_entry(name, info, data_start, what)
    spans = sorted((t.begin, t.end, t.name) for t in tensors.values())
    cursor = data_start
    for begin, end, name in spans:
        if begin != cursor:
            problem = "overlaps the previous tensor" if begin < cursor else "leaves a hole before it"
            raise FormatError(f"{what}: tensor {name!r} {problem} (offset {begin - data_start})")
        cursor = end
    if cursor != file_size:
        raise FormatError(f"{what}: data buffer covers {cursor} bytes but the file has {file_size}")
    return SafetensorsHeader(tensors, dict(metadata), data_start)


def _parse_entry(name: str, info: object, data_start: int, what: str) -> TensorEntry:
    if not isinstance(info, dict):
        raise FormatError(f"{what}: header entry {name!r} is not an object")
    dtype = info.get("dtype")
    shape = info.get("shape")
    offsets = info.get("data_offsets")
    if dtype not in DTYPES:
        raise FormatError(f"{what}: tensor {name!r} has unknown dtype {dtype!r}")
    if (
        not isinstance(shape, list)
        or len(shape) > MAX_TENSOR_RANK
        or not all(isinstance(d, int) and not isinstance(d, bool) and 0 <= d < 2**48 for d in shape)
    ):
        raise FormatError(f"{what}: tensor {name!r} has an invalid shape {shape!r}")
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(isinstance(o, int) and not isinstance(o, bool) and o >= 0 for o in offsets)
        or offsets[0] > offsets[1]
    ):
        raise FormatError(f"{what}: tensor {name!r} has invalid data_offsets {offsets!r}")
    expected = math.prod(shape) * DTYPES[dtype].itemsize
    if offsets[1] - offsets[0] != expected:
        raise FormatError(
            f"{what}: tensor {name!r} spans {offsets[1] - offsets[0]} bytes but {dtype}{shape} needs {expected}"
        )
    return TensorEntry(name, dtype, tuple(shape), data_start + offsets[0], data_start + offsets[1])


def read_header(path: Path) -> SafetensorsHeader:
    """Parse and validate the header of a safetensors file on disk."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise FormatError(f"{path.name}: too short to be a safetensors file ({size} bytes)")
        (header_len,) = struct.unpack("<Q", head)
        if header_len > MAX_SAFETENSORS_HEADER_BYTES or 8 + header_len > size:
            return parse_header(head, size, path.name)  # raises the precise error
        return parse_header(head + f.read(header_len), size, path.name)


class SafetensorsFile:
    """A memory-mapped safetensors file handing out zero-copy numpy views."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.header = read_header(self.path)
        self._file = open(self.path, "rb")  # noqa: SIM115 - kept open for the memory map
        size = self.path.stat().st_size
        self._mmap = mmap.mmap(self._file.fileno(), 0, access=mmap.ACCESS_READ) if size else None

    @property
    def names(self) -> list[str]:
        return sorted(self.header.tensors)

    def array(self, name: str) -> np.ndarray:
        entry = self.header.tensors[name]
        dtype = DTYPES[entry.dtype]
        count = math.prod(entry.shape)
        if count == 0:
            return np.zeros(entry.shape, dtype=dtype)
        return np.frombuffer(self._mmap, dtype=dtype, count=count, offset=entry.begin).reshape(entry.shape)

    def close(self) -> None:
        # Views handed out keep the mapping alive; the mmap is closed when the last of them goes away.
        self._mmap = None
        self._file.close()


def _sha256_stream(f, total: int) -> str:
    f.seek(0)
    h = hashlib.sha256()
    remaining = total
    while remaining:
        chunk = f.read(min(_HASH_CHUNK, remaining))
        if not chunk:
            break
        h.update(chunk)
        remaining -= len(chunk)
    return h.hexdigest()


def sha256_file(path: Path, progress=None) -> str:
    """sha256 of a whole file, read in large chunks; `progress(nbytes)` is called after each chunk."""
    h = hashlib.sha256()
    with open(path, "rb", buffering=0) as f:
        while True:
            chunk = f.read(_HASH_CHUNK)
            if not chunk:
                break
            h.update(chunk)
            if progress is not None:
                progress(len(chunk))
    return h.hexdigest()


def write_arrays(
    path: Path, arrays: Iterable[tuple[str, str, np.ndarray]], metadata: dict[str, str] | None = None
) -> FileInfo:
    """Write (name, safetensors dtype, array) triples, in name order, to `path`; return its size and sha256.

    The file is written under a temporary name and renamed into place, so `path` is either absent or complete.
    """
    items = sorted(arrays, key=lambda item: item[0])
    names = [name for name, _, _ in items]
    if len(set(names)) != len(names):
        raise FormatError(f"duplicate tensor names in {path.name}")
    header: dict[str, object] = {}
    if metadata:
        header["__metadata__"] = dict(sorted(metadata.items()))
    offset = 0
    for name, dtype, array in items:
        nbytes = int(array.size) * DTYPES[dtype].itemsize
        header[name] = {"dtype": dtype, "shape": [int(d) for d in array.shape], "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    header_bytes = json.dumps(header, separators=(",", ":")).encode("utf-8")
    header_bytes += b" " * (-len(header_bytes) % 8)
    path = Path(path)
    tmp = path.with_name(path.name + ".partial")
    h = hashlib.sha256()
    with open(tmp, "wb") as f:
        for chunk in (struct.pack("<Q", len(header_bytes)), header_bytes):
            f.write(chunk)
            h.update(chunk)
        for _, dtype, array in items:
            data = np.ascontiguousarray(array, dtype=DTYPES[dtype]).tobytes()
            f.write(data)
            h.update(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return FileInfo(path.name, 8 + len(header_bytes) + offset, h.hexdigest())
