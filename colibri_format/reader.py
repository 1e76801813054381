"""Reading containers: validate cheaply on open, then hand out zero-copy views from memory-mapped files.

`Container.open` checks everything that costs no more than reading headers: the manifest's format and version, plain
file names, every file's presence and size, safetensors headers (bounds, holes, overlaps, duplicate names), expert
data file headers, the expert index's checksum, schema, bounds, alignment, overlaps and duplicates. Payload
checksums (every record's crc32, every file's sha256) are the deep verification's job (`colibri-inspect verify
--deep`), or ask for one record with `Container.verify_record`.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import mmap
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .constants import (
    EXPERT_FILE_HEADER_SIZE,
    EXPERT_INDEX_NAME,
    EXPERT_PARTS,
    FORMAT_NAME,
    MANIFEST_NAME,
    MAX_MANIFEST_BYTES,
    RECORD_ALIGNMENT,
    SAFETENSORS_ENCODINGS_KEY,
    SCALES_SUFFIX,
    SUPPORTED_FORMAT_VERSIONS,
    Encoding,
)
from .errors import FormatError, IntegrityError, VersionError
from .names import check_file_name
from .quant import QuantizedTensor, stored_layout
from .records import RecordLayout, check_expert_file_header, decode_record, record_crc32, record_layout
from .safetensors_io import DTYPES, SafetensorsFile, read_header, reject_duplicate_keys

FILE_ROLES = ("verbatim", "resident", "mtp", "experts", "index")
INDEX_COLUMNS = {
    "layer": "int32",
    "expert": "int32",
    "file": "string",
    "offset": "uint64",
    "length": "uint64",
    "crc32": "uint32",
    "gate_encoding": "string",
    "up_encoding": "string",
    "down_encoding": "string",
}


@dataclass(frozen=True)
class ExpertRecord:
    """One routed expert's three matrices, as encoded tensors (views into the container or a read buffer)."""

    gate: QuantizedTensor
    up: QuantizedTensor
    down: QuantizedTensor

    @property
    def nbytes(self) -> int:
        return self.gate.nbytes + self.up.nbytes + self.down.nbytes


@dataclass(frozen=True)
class RecordLocation:
    """Where one expert record lives: absolute path, byte offset, payload length and crc32 of the payload."""

    path: Path
    file: str
    offset: int
    length: int
    crc32: int

    @property
    def padded_length(self) -> int:
        return -(-self.length // RECORD_ALIGNMENT) * RECORD_ALIGNMENT


def load_manifest(path: Path) -> dict:
    """Read and check the manifest of the container at `path` (format name, version, shape of the document)."""
    path = Path(path)
    manifest_path = path / MANIFEST_NAME
    if not path.is_dir():
        raise FormatError(f"{path} is not a directory; a Colibri container is a directory holding {MANIFEST_NAME}")
    if not manifest_path.is_file():
        raise FormatError(
            f"{path} has no {MANIFEST_NAME}: not a Colibri container, or an unfinished conversion (rerun it)"
        )
    size = manifest_path.stat().st_size
    if size > MAX_MANIFEST_BYTES:
        raise FormatError(f"{manifest_path}: manifest of {size} bytes exceeds the {MAX_MANIFEST_BYTES} byte limit")
    try:
        manifest = json.loads(manifest_path.read_bytes(), object_pairs_hook=reject_duplicate_keys)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise FormatError(f"{manifest_path}: not valid JSON ({exc})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT_NAME:
        raise FormatError(f"{manifest_path}: not a Colibri manifest (format is not {FORMAT_NAME!r})")
    version = manifest.get("format_version")
    if not isinstance(version, int) or isinstance(version, bool):
        raise FormatError(f"{manifest_path}: format_version must be an integer")
    if version not in SUPPORTED_FORMAT_VERSIONS:
        raise VersionError(
            f"{path} uses container format version {version}, but this Colibri reads version(s) "
            f"{', '.join(map(str, SUPPORTED_FORMAT_VERSIONS))}; upgrade Colibri to read it"
        )
    for key, kind in (("family", str), ("files", dict), ("experts", dict), ("recipe", dict), ("fingerprint", str)):
        if not isinstance(manifest.get(key), kind):
            raise FormatError(f"{manifest_path}: missing or malformed {key!r}")
    for name, info in manifest["files"].items():
        check_file_name(name)
        if (
            not isinstance(info, dict)
            or info.get("role") not in FILE_ROLES
            or not isinstance(info.get("size"), int)
            or not isinstance(info.get("sha256"), str)
        ):
            raise FormatError(f"{manifest_path}: malformed entry for file {name!r}")
    return manifest


class Container:
    """An open container. Use `Container.open(path)`; views it hands out stay valid while it is open."""

    def __init__(self, path: Path, manifest: dict):
        self.path = Path(path)
        self.manifest = manifest
        self.family: str = manifest["family"]
        self.fingerprint: str = manifest["fingerprint"]
        self._mmaps: dict[str, mmap.mmap] = {}
        self._files: list = []
        self._tensors: dict[str, tuple[str, str, tuple[int, ...], str]] = {}  # name -> (file, encoding, shape, role)
        self._safetensors: dict[str, SafetensorsFile] = {}
        self._layouts: dict[tuple[str, str, str], RecordLayout] = {}
        self._rows: dict[tuple[int, int], int] = {}

    # --- opening and validation -----------------------------------------------------------------------------------

    @classmethod
    def open(cls, path: Path | str) -> Container:
        path = Path(path)
        container = cls(path, load_manifest(path))
        try:
            container._check_files()
            container.config = container._load_config()
            container._load_tensors()
            container._load_index()
        except BaseException:
            container.close()
            raise
        return container

    def files_of_role(self, role: str) -> list[str]:
        return sorted(n for n, info in self.manifest["files"].items() if info["role"] == role)

    def _check_files(self) -> None:
        for name, info in sorted(self.manifest["files"].items()):
            p = self.path / name
            if not p.is_file():
                raise FormatError(f"{self.path}: file {name} listed in the manifest is missing; re-download it")
            size = p.stat().st_size
            if size != info["size"]:
                raise FormatError(
                    f"{p}: {size} bytes on disk, the manifest says {info['size']}: the file is truncated or was "
                    "changed; re-download or re-convert it"
                )
        if "config.json" not in self.manifest["files"]:
            raise FormatError(f"{self.path}: the manifest lists no config.json")
        if EXPERT_INDEX_NAME not in self.manifest["files"] and self.manifest["experts"].get("records", 0):
            raise FormatError(f"{self.path}: the manifest lists no {EXPERT_INDEX_NAME}")

    def _load_config(self) -> dict:
        try:
            config = json.loads((self.path / "config.json").read_bytes())
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise FormatError(f"{self.path / 'config.json'}: not valid JSON ({exc})") from None
        if not isinstance(config, dict):
            raise FormatError(f"{self.path / 'config.json'}: not a JSON object")
        return config

    def _load_tensors(self) -> None:
        for role in ("resident", "mtp"):
            for name in self.files_of_role(role):
                header = read_header(self.path / name)
                try:
                    encodings = json.loads(header.metadata.get(SAFETENSORS_ENCODINGS_KEY, "{}"))
                except json.JSONDecodeError:
                    raise FormatError(f"{name}: metadata {SAFETENSORS_ENCODINGS_KEY} is not valid JSON") from None
                if not isinstance(encodings, dict):
                    raise FormatError(f"{name}: metadata {SAFETENSORS_ENCODINGS_KEY} is not a JSON object")
                stored = set(header.tensors)
                for tensor, desc in encodings.items():
                    self._register_tensor(name, role, tensor, desc, header.tensors)
                    stored.discard(tensor)
                    stored.discard(tensor + SCALES_SUFFIX)
                if stored:
                    raise FormatError(f"{name}: tensors without an encoding entry: {', '.join(sorted(stored)[:5])}")

    def _register_tensor(self, file: str, role: str, tensor: str, desc: object, entries: dict) -> None:
        if tensor in self._tensors:
            raise FormatError(f"tensor {tensor!r} appears in both {self._tensors[tensor][0]} and {file}")
        if not isinstance(desc, dict) or desc.get("encoding") not in Encoding.ALL or not isinstance(desc.get("shape"), list):
            raise FormatError(f"{file}: malformed encoding entry for tensor {tensor!r}")
        shape = tuple(desc["shape"])
        if not all(isinstance(d, int) and d >= 0 for d in shape):
            raise FormatError(f"{file}: tensor {tensor!r} has an invalid logical shape {desc['shape']!r}")
        layout = stored_layout(desc["encoding"], shape)
        for (dtype, seg_shape), stored_name in zip(layout, (tensor, tensor + SCALES_SUFFIX)):
            entry = entries.get(stored_name)
            if entry is None:
                raise FormatError(f"{file}: tensor {stored_name!r} is missing")
            stored_dtype = np.dtype("<u2") if desc["encoding"] == Encoding.BF16 else np.dtype(dtype)
            if DTYPES[entry.dtype] != stored_dtype.newbyteorder("<") or entry.shape != tuple(seg_shape):
                raise FormatError(
                    f"{file}: tensor {stored_name!r} is {entry.dtype}{list(entry.shape)}, but encoding "
                    f"{desc['encoding']} of shape {list(shape)} needs {dtype}{list(seg_shape)}"
                )
        self._tensors[tensor] = (file, desc["encoding"], shape, role)

    def _load_index(self) -> None:
        import pyarrow as pa

        experts = self.manifest["experts"]
        if EXPERT_INDEX_NAME not in self.manifest["files"]:
            self._index = {k: np.zeros(0) for k in INDEX_COLUMNS}
            return
        index_path = self.path / EXPERT_INDEX_NAME
        raw = index_path.read_bytes()
        if hashlib.sha256(raw).hexdigest() != self.manifest["files"][EXPERT_INDEX_NAME]["sha256"]:
            raise IntegrityError(f"{index_path}: checksum does not match the manifest; the index is corrupt")
        try:
            table = pa.ipc.open_file(pa.BufferReader(raw)).read_all()
            table.validate(full=True)
        except (pa.ArrowException, OSError, ValueError) as exc:
            raise FormatError(f"{index_path}: not a readable Arrow IPC file ({exc})") from None
        for column, kind in INDEX_COLUMNS.items():
            if column not in table.column_names or str(table.schema.field(column).type) != kind:
                raise FormatError(f"{index_path}: column {column!r} missing or not of type {kind}")
        cols = {c: table.column(c).to_numpy(zero_copy_only=False) for c in INDEX_COLUMNS}
        self._index = cols
        self._validate_index(cols, experts)
        for row, key in enumerate(zip(cols["layer"].tolist(), cols["expert"].tolist())):
            self._rows[key] = row

    def _validate_index(self, cols: dict, experts: dict) -> None:
        n = len(cols["layer"])
        if n != experts.get("records", n):
            raise FormatError(f"expert index has {n} rows, the manifest says {experts.get('records')}")
        expert_files = set(self.files_of_role("experts"))
        num_experts = int(experts.get("num_experts", 0))
        layers = set(experts.get("layers", []))
        shapes = experts.get("shapes", {})
        if n and set(shapes) != set(EXPERT_PARTS):
            raise FormatError(f"manifest expert shapes must name {', '.join(EXPERT_PARTS)}")
        for name in expert_files:
            with open(self.path / name, "rb") as f:
                check_expert_file_header(f.read(EXPERT_FILE_HEADER_SIZE), name)
        seen: set[tuple[int, int]] = set()
        spans: dict[str, list[tuple[int, int, int, int]]] = {}
        for i in range(n):
            layer, expert = int(cols["layer"][i]), int(cols["expert"][i])
            where = f"expert index row {i} (layer {layer}, expert {expert})"
            if (layer, expert) in seen:
                raise FormatError(f"{where}: duplicate (layer, expert)")
            seen.add((layer, expert))
            if layer not in layers or not 0 <= expert < num_experts:
                raise FormatError(f"{where}: outside the manifest's layers or expert count")
            file = cols["file"][i]
            if file not in expert_files:
                raise FormatError(f"{where}: names {file!r}, which is not an expert data file of this container")
            offset, length = int(cols["offset"][i]), int(cols["length"][i])
            encodings = (cols["gate_encoding"][i], cols["up_encoding"][i], cols["down_encoding"][i])
            layout = self._layout(encodings, where)
            if length != layout.length:
                raise FormatError(f"{where}: length {length} but its shapes and encodings need {layout.length}")
            if offset < EXPERT_FILE_HEADER_SIZE or offset % RECORD_ALIGNMENT:
                raise FormatError(f"{where}: offset {offset} is not a {RECORD_ALIGNMENT}-aligned record offset")
            size = self.manifest["files"][file]["size"]
            if offset + length > size:
                raise FormatError(f"{where}: record ends at {offset + length}, past the end of {file} ({size} bytes)")
            spans.setdefault(file, []).append((offset, offset + length, layer, expert))
        for file, file_spans in spans.items():
            file_spans.sort()
            for (_, e0, l0, x0), (b1, _, l1, x1) in itertools.pairwise(file_spans):
                if b1 < e0:
                    raise FormatError(f"{file}: records of ({l0}, {x0}) and ({l1}, {x1}) overlap")

    def _layout(self, encodings: tuple[str, str, str], where: str = "expert record") -> RecordLayout:
        key = tuple(str(e) for e in encodings)
        layout = self._layouts.get(key)
        if layout is None:
            if not all(e in Encoding.ALL for e in key):
                raise FormatError(f"{where}: unknown encodings {key}")
            shapes = {k: tuple(v) for k, v in self.manifest["experts"]["shapes"].items()}
            layout = record_layout(shapes, key)
            self._layouts[key] = layout
        return layout

    # --- tensors ----------------------------------------------------------------------------------------------------

    def tensor_names(self, group: str | None = None) -> list[str]:
        return sorted(n for n, (_, _, _, role) in self._tensors.items() if group is None or role == group)

    def has_tensor(self, name: str) -> bool:
        return name in self._tensors

    def tensor_encoding(self, name: str) -> tuple[str, tuple[int, ...]]:
        _, encoding, shape, _ = self._tensors[name]
        return encoding, shape

    def tensor(self, name: str) -> QuantizedTensor:
        """A zero-copy view of one resident or MTP tensor."""
        if name not in self._tensors:
            raise KeyError(f"no tensor named {name!r} in {self.path}")
        file, encoding, shape, _ = self._tensors[name]
        st = self._safetensors.get(file)
        if st is None:
            st = self._safetensors[file] = SafetensorsFile(self.path / file)
        data = st.array(name)
        scales = st.array(name + SCALES_SUFFIX) if encoding in Encoding.QUANTIZED else None
        return QuantizedTensor(encoding, shape, data, scales)

    # --- experts ----------------------------------------------------------------------------------------------------

    @property
    def expert_layers(self) -> list[int]:
        return sorted({layer for layer, _ in self._rows})

    @property
    def num_experts(self) -> int:
        return int(self.manifest["experts"].get("num_experts", 0))

    @property
    def num_records(self) -> int:
        return len(self._rows)

    def has_expert(self, layer: int, expert: int) -> bool:
        return (int(layer), int(expert)) in self._rows

    def _row(self, layer: int, expert: int) -> int:
        try:
            return self._rows[(int(layer), int(expert))]
        except KeyError:
            raise KeyError(f"no expert ({layer}, {expert}) in {self.path}") from None

    def record_location(self, layer: int, expert: int) -> RecordLocation:
        row = self._row(layer, expert)
        file = str(self._index["file"][row])
        return RecordLocation(
            self.path / file,
            file,
            int(self._index["offset"][row]),
            int(self._index["length"][row]),
            int(self._index["crc32"][row]),
        )

    def record_layout(self, layer: int, expert: int) -> RecordLayout:
        row = self._row(layer, expert)
        idx = self._index
        return self._layout((idx["gate_encoding"][row], idx["up_encoding"][row], idx["down_encoding"][row]))

    def _mmap(self, file: str) -> mmap.mmap:
        mm = self._mmaps.get(file)
        if mm is None:
            f = open(self.path / file, "rb")  # noqa: SIM115 - kept open while the container is
            self._files.append(f)
            mm = self._mmaps[file] = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        return mm

    def record_bytes(self, layer: int, expert: int) -> memoryview:
        """The payload bytes of one record, zero-copy from the memory-mapped data file."""
        loc = self.record_location(layer, expert)
        return memoryview(self._mmap(loc.file))[loc.offset : loc.offset + loc.length]

    def expert(self, layer: int, expert: int) -> ExpertRecord:
        """Zero-copy views of one expert's gate, up and down from the memory-mapped data file."""
        return self.decode_record(self.record_bytes(layer, expert), layer, expert)

    def decode_record(self, buffer, layer: int, expert: int) -> ExpertRecord:
        """Views of one expert's parts over a buffer holding its record (e.g. read with pread or O_DIRECT)."""
        parts = decode_record(buffer, self.record_layout(layer, expert))
        return ExpertRecord(parts["gate"], parts["up"], parts["down"])

    def verify_record(self, layer: int, expert: int) -> None:
        """Check one record's crc32; raise IntegrityError naming the expert if it does not match."""
        self.verify_record_bytes(layer, expert, self.record_bytes(layer, expert))

    def verify_record_bytes(self, layer: int, expert: int, payload) -> None:
        """Check the crc32 of a record's payload read into some buffer (its first `length` bytes)."""
        loc = self.record_location(layer, expert)
        if record_crc32(memoryview(payload)[: loc.length]) != loc.crc32:
            raise IntegrityError(f"{loc.file}: record of expert ({layer}, {expert}) fails its crc32 check")

    def iter_records(self):
        """(layer, expert, RecordLocation) for every record, in file and offset order (the order to read them in)."""
        keys = sorted(self._rows, key=lambda k: (self._index["file"][self._rows[k]], self._index["offset"][self._rows[k]]))
        for layer, expert in keys:
            yield layer, expert, self.record_location(layer, expert)

    # --- lifetime ---------------------------------------------------------------------------------------------------

    def close(self) -> None:
        for st in self._safetensors.values():
            st.close()
        self._safetensors.clear()
        self._mmaps.clear()  # mappings close once no view refers to them
        for f in self._files:
            f.close()
        self._files.clear()

    def __enter__(self) -> Container:  # noqa: PYI034
        return self

    def __exit__(self, *exc) -> None:
        self.close()
