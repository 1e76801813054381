"""Expert records and expert data files (specs/CONTAINER.md, "Expert data files" and "Expert records").

A record holds one expert's gate, up and down weights with all their scales, back to back, so that one read loads
the expert. Inside a record every segment (a part's data, then its scales) starts on a PART_ALIGNMENT boundary; a
record starts on a RECORD_ALIGNMENT boundary of its data file, after the file's fixed header.
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass

import numpy as np

from .constants import (
    EXPERT_FILE_HEADER_SIZE,
    EXPERT_FILE_MAGIC,
    EXPERT_PARTS,
    FORMAT_VERSION,
    PART_ALIGNMENT,
    RECORD_ALIGNMENT,
    SUPPORTED_FORMAT_VERSIONS,
)
from .errors import FormatError, VersionError
from .quant import QuantizedTensor, stored_layout

# magic, format version, header size, record alignment, part alignment
_HEADER_STRUCT = struct.Struct("<8sIIII")


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def expert_file_header() -> bytes:
    """The fixed 4096-byte header every expert data file starts with."""
    fields = _HEADER_STRUCT.pack(
        EXPERT_FILE_MAGIC, FORMAT_VERSION, EXPERT_FILE_HEADER_SIZE, RECORD_ALIGNMENT, PART_ALIGNMENT
    )
    return fields + b"\0" * (EXPERT_FILE_HEADER_SIZE - len(fields))


def check_expert_file_header(head: bytes, what: str) -> None:
    if len(head) < _HEADER_STRUCT.size:
        raise FormatError(f"{what}: too short for an expert data file header")
    magic, version, header_size, record_alignment, part_alignment = _HEADER_STRUCT.unpack_from(head)
    if magic != EXPERT_FILE_MAGIC:
        raise FormatError(f"{what}: not a Colibri expert data file (bad magic {magic!r})")
    if version not in SUPPORTED_FORMAT_VERSIONS:
        raise VersionError(
            f"{what}: expert data file format version {version} is not supported (this library reads "
            f"{', '.join(map(str, SUPPORTED_FORMAT_VERSIONS))}); upgrade Colibri"
        )
    if (header_size, record_alignment, part_alignment) != (EXPERT_FILE_HEADER_SIZE, RECORD_ALIGNMENT, PART_ALIGNMENT):
        raise FormatError(f"{what}: unexpected header geometry {header_size}/{record_alignment}/{part_alignment}")


@dataclass(frozen=True)
class Segment:
    """One stored array inside a record: its byte offset from the record start, dtype and shape."""

    offset: int
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return int(np.dtype(self.dtype).itemsize * np.prod(self.shape, dtype=np.int64))


@dataclass(frozen=True)
class PartLayout:
    name: str
    encoding: str
    shape: tuple[int, ...]
    segments: tuple[Segment, ...]  # data, then scales for grouped encodings


@dataclass(frozen=True)
class RecordLayout:
    """Where each part of an expert record lives; `length` is the record's payload size (without padding)."""

    parts: tuple[PartLayout, ...]
    length: int


def record_layout(shapes: dict[str, tuple[int, ...]], encodings: tuple[str, str, str]) -> RecordLayout:
    """The layout of a record whose parts (gate, up, down) have these logical shapes and encodings."""
    cursor = 0
    parts = []
    for name, encoding in zip(EXPERT_PARTS, encodings):
        shape = tuple(int(d) for d in shapes[name])
        segments = []
        for dtype, seg_shape in stored_layout(encoding, shape):
            cursor = round_up(cursor, PART_ALIGNMENT)
            seg = Segment(cursor, dtype, tuple(seg_shape))
            segments.append(seg)
            cursor += seg.nbytes
        parts.append(PartLayout(name, encoding, shape, tuple(segments)))
    return RecordLayout(tuple(parts), cursor)


def record_chunks(parts: dict[str, QuantizedTensor]) -> tuple[list, RecordLayout]:
    """The payload of one record as a list of bytes-like chunks (alignment zeros and zero-copy array views, in
    order; their concatenation is the payload without the trailing padding) and its layout."""
    shapes = {name: parts[name].shape for name in EXPERT_PARTS}
    encodings = tuple(parts[name].encoding for name in EXPERT_PARTS)
    layout = record_layout(shapes, encodings)
    chunks: list = []
    cursor = 0
    for part in layout.parts:
        t = parts[part.name]
        arrays = (t.data,) if t.scales is None else (t.data, t.scales)
        if len(arrays) != len(part.segments):
            raise FormatError(f"expert part {part.name}: {len(arrays)} arrays for {len(part.segments)} segments")
        for seg, array in zip(part.segments, arrays):
            a = np.ascontiguousarray(array)
            if a.dtype != np.dtype(seg.dtype) or tuple(a.shape) != seg.shape:
                raise FormatError(
                    f"expert part {part.name}: stored array {a.dtype}{a.shape} does not match {seg.dtype}{seg.shape}"
                )
            if seg.offset > cursor:
                chunks.append(bytes(seg.offset - cursor))
            chunks.append(memoryview(a).cast("B"))
            cursor = seg.offset + seg.nbytes
    return chunks, layout


def encode_record(parts: dict[str, QuantizedTensor]) -> tuple[bytes, RecordLayout]:
    """The payload bytes of one record (without alignment padding) and its layout."""
    chunks, layout = record_chunks(parts)
    return b"".join(chunks), layout


def decode_record(buffer, layout: RecordLayout) -> dict[str, QuantizedTensor]:
    """Zero-copy QuantizedTensor views of a record's parts over `buffer` (bytes, memoryview, mmap or uint8 array)."""
    raw = np.frombuffer(buffer, dtype=np.uint8, count=layout.length) if not isinstance(buffer, np.ndarray) else buffer
    if raw.nbytes < layout.length:
        raise FormatError(f"expert record buffer holds {raw.nbytes} bytes but the record needs {layout.length}")
    out = {}
    for part in layout.parts:
        arrays = [
            raw[seg.offset : seg.offset + seg.nbytes].view(np.dtype(seg.dtype)).reshape(seg.shape)
            for seg in part.segments
        ]
        scales = arrays[1] if len(arrays) > 1 else None
        out[part.name] = QuantizedTensor(part.encoding, part.shape, arrays[0], scales)
    return out


def record_crc32(payload) -> int:
    return zlib.crc32(payload) & 0xFFFFFFFF
