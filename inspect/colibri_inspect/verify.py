"""Container verification: every problem a container has, as findings, never only the first.

`Container.open` stops at the first thing wrong because a runtime cannot use a broken container. A verifier must
tell the whole story, so this module re-reads the container with its own lenient loop and keeps going after each
problem. Fast verification reads only the manifest, headers and the index; deep verification also reads every byte
once (see scan.py) to check every file's sha256, every record's crc32 and that every scale is finite.

Each finding has a stable `code` (tests and scripts match on it) and a message that says what to do:

    manifest-missing manifest-invalid manifest-version manifest-field   the manifest itself
    unsafe-name file-missing file-size unlisted-file read-error          files
    config shard-set                                                     config.json, file numbering
    safetensors-header tensor-encoding tensor-duplicate tensor-shape tensor-dtype   resident and MTP tensors
    expert-header index-checksum index-invalid index-row index-duplicate index-file index-length
    index-alignment index-bounds index-overlap index-hole expert-missing expert-layers expert-shape    experts
    file-sha256 record-crc non-finite                                    payload (deep only)
"""

from __future__ import annotations

import hashlib
import json
import re
import struct
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from colibri_format.constants import (
    EXPERT_FILE_HEADER_SIZE,
    EXPERT_FILE_PATTERN,
    EXPERT_INDEX_NAME,
    EXPERT_PARTS,
    FORMAT_NAME,
    MANIFEST_NAME,
    MAX_MANIFEST_BYTES,
    MAX_SAFETENSORS_HEADER_BYTES,
    MTP_FILE_PATTERN,
    RECORD_ALIGNMENT,
    RESIDENT_FILE_PATTERN,
    SAFETENSORS_ENCODINGS_KEY,
    SCALES_SUFFIX,
    SUPPORTED_FORMAT_VERSIONS,
    USAGE_FILE_NAME,
    Encoding,
)
from colibri_format.errors import ColibriError, FormatError
from colibri_format.names import check_file_name
from colibri_format.quant import stored_layout
from colibri_format.reader import FILE_ROLES, INDEX_COLUMNS
from colibri_format.records import RecordLayout, check_expert_file_header, record_layout, round_up
from colibri_format.safetensors_io import DTYPES, parse_header, reject_duplicate_keys

from .dims import ModelDims
from .scan import DEFAULT_CHUNK_BYTES, Progress, scan_files

ERROR = "error"
WARNING = "warning"
# Files a container directory may hold besides those its manifest lists.
SIDE_FILES = re.compile(rf"^({re.escape(USAGE_FILE_NAME)}.*|.*\.coli_kv|\.colibri-.*|\..*\.tmp)$")
MAX_FINDINGS_PER_CODE = 200


@dataclass(frozen=True)
class Finding:
    severity: str  # "error" or "warning"
    code: str
    message: str
    file: str | None = None

    def to_json(self) -> dict:
        return {"severity": self.severity, "code": self.code, "file": self.file, "message": self.message}


@dataclass
class VerifyReport:
    path: Path
    deep: bool
    findings: list[Finding] = field(default_factory=list)
    files_checked: int = 0
    records_checked: int = 0
    tensors_checked: int = 0
    bytes_read: int = 0
    read_seconds: float = 0.0
    seconds: float = 0.0
    suppressed: dict[str, int] = field(default_factory=dict)

    @property
    def errors(self) -> list[Finding]:
        return [f for f in self.findings if f.severity == ERROR]

    @property
    def warnings(self) -> list[Finding]:
        return [f for f in self.findings if f.severity == WARNING]

    @property
    def ok(self) -> bool:
        return not self.errors

    @property
    def codes(self) -> set[str]:
        return {f.code for f in self.findings}

    @property
    def read_gbps(self) -> float:
        return self.bytes_read / self.read_seconds / 1e9 if self.read_seconds > 0 else 0.0

    def to_json(self) -> dict:
        return {
            "path": str(self.path),
            "deep": self.deep,
            "ok": self.ok,
            "errors": len(self.errors),
            "warnings": len(self.warnings),
            "files_checked": self.files_checked,
            "records_checked": self.records_checked,
            "tensors_checked": self.tensors_checked,
            "bytes_read": self.bytes_read,
            "read_seconds": round(self.read_seconds, 4),
            "read_gbps": round(self.read_gbps, 3),
            "seconds": round(self.seconds, 4),
            "suppressed": self.suppressed,
            "findings": [f.to_json() for f in self.findings],
        }


@dataclass(frozen=True)
class _Tensor:
    file: str
    role: str
    encoding: str
    shape: tuple[int, ...]
    segments: tuple[tuple[str, int, int, str], ...]  # (stored name, begin, end, numpy dtype)


@dataclass(frozen=True)
class _Record:
    layer: int
    expert: int
    file: str
    offset: int
    length: int
    crc32: int
    layout: RecordLayout


class _Verifier:
    def __init__(
        self, path: Path, deep: bool, progress: Progress | None, jobs: int | None, chunk_bytes: int, crc_only: bool
    ):
        self.path = Path(path)
        self.crc_only = crc_only
        self.chunk_bytes = chunk_bytes
        self.report = VerifyReport(self.path, deep)
        self.progress = progress
        self.jobs = jobs
        self.manifest: dict = {}
        self.files: dict[str, dict] = {}  # safe, well-formed manifest entries
        self.sizes: dict[str, int] = {}  # files present on disk: actual size
        self.config: dict | None = None
        self.dims: ModelDims | None = None
        self.tensors: dict[str, _Tensor] = {}
        self.records: list[_Record] = []
        self.good_expert_files: set[str] = set()
        self._per_code: dict[str, int] = {}

    def add(self, severity: str, code: str, message: str, file: str | None = None) -> None:
        self._per_code[code] = self._per_code.get(code, 0) + 1
        if self._per_code[code] > MAX_FINDINGS_PER_CODE:
            self.report.suppressed[code] = self.report.suppressed.get(code, 0) + 1
            return
        self.report.findings.append(Finding(severity, code, message, file))

    def error(self, code: str, message: str, file: str | None = None) -> None:
        self.add(ERROR, code, message, file)

    def warn(self, code: str, message: str, file: str | None = None) -> None:
        self.add(WARNING, code, message, file)

    # --- the whole run ------------------------------------------------------------------------------------------

    def run(self) -> VerifyReport:
        start = time.perf_counter()
        if self._check_manifest():
            self._check_files()
            self._check_config()
            self._check_tensors()
            self._check_expert_headers()
            self._check_index()
            self._check_completeness()
            if self.report.deep:
                self._scan_payloads()
        self.report.seconds = time.perf_counter() - start
        return self.report

    # --- manifest -----------------------------------------------------------------------------------------------

    def _check_manifest(self) -> bool:
        """Check the manifest; False when nothing else can be interpreted."""
        mpath = self.path / MANIFEST_NAME
        if not self.path.is_dir():
            self.error("manifest-missing", f"{self.path} is not a directory; a container is a directory with {MANIFEST_NAME}")
            return False
        if not mpath.is_file():
            self.error(
                "manifest-missing",
                f"no {MANIFEST_NAME}: not a container, or an unfinished conversion (rerun the conversion)",
                MANIFEST_NAME,
            )
            return False
        size = mpath.stat().st_size
        if size > MAX_MANIFEST_BYTES:
            self.error("manifest-invalid", f"manifest of {size} bytes exceeds the {MAX_MANIFEST_BYTES} limit", MANIFEST_NAME)
            return False
        try:
            manifest = json.loads(mpath.read_bytes(), object_pairs_hook=reject_duplicate_keys)
        except (UnicodeDecodeError, json.JSONDecodeError, FormatError) as exc:
            self.error("manifest-invalid", f"manifest is not valid JSON ({exc}); re-download it", MANIFEST_NAME)
            return False
        if not isinstance(manifest, dict) or manifest.get("format") != FORMAT_NAME:
            self.error("manifest-invalid", f"not a Colibri manifest (format is not {FORMAT_NAME!r})", MANIFEST_NAME)
            return False
        version = manifest.get("format_version")
        if not isinstance(version, int) or isinstance(version, bool):
            self.error("manifest-version", "format_version is missing or not an integer", MANIFEST_NAME)
            return False
        if version not in SUPPORTED_FORMAT_VERSIONS:
            supported = ", ".join(map(str, SUPPORTED_FORMAT_VERSIONS))
            newer = version > max(SUPPORTED_FORMAT_VERSIONS)
            self.error(
                "manifest-version",
                f"container format version {version} is not supported (this Colibri reads {supported})"
                + ("; upgrade Colibri" if newer else "; re-convert the checkpoint"),
                MANIFEST_NAME,
            )
            return False
        self.manifest = manifest
        usable = True
        for key, kind in (("family", str), ("files", dict), ("experts", dict), ("recipe", dict), ("fingerprint", str)):
            if not isinstance(manifest.get(key), kind):
                self.error("manifest-field", f"manifest field {key!r} is missing or not a {kind.__name__}", MANIFEST_NAME)
                usable = usable and key not in ("files", "experts")
        if not usable:
            return False
        for name, info in manifest["files"].items():
            try:
                check_file_name(name)
            except FormatError:
                self.error(
                    "unsafe-name",
                    f"manifest lists file {name!r}, which is not a plain name inside the container (path traversal); "
                    "the container is untrustworthy: do not use it",
                    MANIFEST_NAME,
                )
                continue
            if (
                not isinstance(info, dict)
                or info.get("role") not in FILE_ROLES
                or not _is_int(info.get("size"))
                or not isinstance(info.get("sha256"), str)
            ):
                self.error("manifest-field", f"manifest entry for {name!r} needs role, integer size and sha256", MANIFEST_NAME)
                continue
            self.files[name] = info
        if "fingerprint" in manifest and isinstance(manifest["fingerprint"], str):
            from colibri_format.writer import model_fingerprint

            complete = self.files and len(self.files) == len(manifest["files"])
            if complete and model_fingerprint(self.files) != manifest["fingerprint"]:
                self.error("manifest-field", "fingerprint does not match the listed files' sha256s", MANIFEST_NAME)
        return True

    # --- files --------------------------------------------------------------------------------------------------

    def _check_files(self) -> None:
        for name, info in sorted(self.files.items()):
            p = self.path / name
            if not p.is_file():
                self.error("file-missing", f"{name} ({info['role']}) is listed in the manifest but missing; re-download it", name)
                continue
            size = p.stat().st_size
            self.sizes[name] = size
            if size != info["size"]:
                what = "truncated" if size < info["size"] else "longer than written"
                self.error(
                    "file-size",
                    f"{name} has {size} bytes, the manifest says {info['size']} ({what}); re-download or re-convert it",
                    name,
                )
        listed = set(self.manifest["files"]) | {MANIFEST_NAME}
        for p in sorted(self.path.iterdir()):
            if p.name not in listed and p.is_file() and not SIDE_FILES.match(p.name):
                kind = "an unfinished write" if p.name.endswith(".partial") else "not part of the container"
                self.warn("unlisted-file", f"{p.name} is not listed in the manifest ({kind}); it is ignored", p.name)
        self.report.files_checked = len(self.sizes)
        self._check_shard_set()

    def _check_shard_set(self) -> None:
        patterns = {"resident": RESIDENT_FILE_PATTERN, "mtp": MTP_FILE_PATTERN, "experts": EXPERT_FILE_PATTERN}
        for role, pattern in patterns.items():
            names = sorted(n for n, i in self.files.items() if i["role"] == role)
            expected = [pattern.format(i + 1) for i in range(len(names))]
            if names != expected:
                self.error(
                    "shard-set",
                    f"{role} files are {', '.join(names[:6]) or 'none'}; expected the sequence "
                    f"{', '.join(expected[:6])}{'...' if len(expected) > 6 else ''} (a shard is misnamed or missing)",
                )
        if EXPERT_INDEX_NAME not in self.files and (self.manifest["experts"].get("records") or
                                                    any(i["role"] == "experts" for i in self.files.values())):
            self.error("file-missing", f"the manifest lists expert data but no {EXPERT_INDEX_NAME}", EXPERT_INDEX_NAME)

    def _check_config(self) -> None:
        if "config.json" not in self.files:
            self.error("config", "the manifest lists no config.json; the model cannot be described", "config.json")
            return
        if "config.json" not in self.sizes:
            return
        try:
            config = json.loads((self.path / "config.json").read_bytes())
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            self.error("config", f"config.json is not valid JSON ({exc})", "config.json")
            return
        if not isinstance(config, dict):
            self.error("config", "config.json is not a JSON object", "config.json")
            return
        self.config = config
        self.dims = ModelDims.from_config(str(self.manifest.get("family", "")), config)
        if not (self.dims.layers and self.dims.hidden):
            self.error("config", "config.json lacks num_hidden_layers or hidden_size", "config.json")

    # --- resident and MTP tensors ---------------------------------------------------------------------------------

    def _check_tensors(self) -> None:
        for name in sorted(n for n, i in self.files.items() if i["role"] in ("resident", "mtp")):
            if name in self.sizes:
                self._check_safetensors_file(name, self.files[name]["role"])
        if self.dims is not None:
            self._check_tensor_shapes()

    def _check_safetensors_file(self, name: str, role: str) -> None:
        p = self.path / name
        size = self.sizes[name]
        try:
            with open(p, "rb") as f:
                head = f.read(8)
                if len(head) == 8:
                    (header_len,) = struct.unpack("<Q", head)
                    if header_len <= MAX_SAFETENSORS_HEADER_BYTES and 8 + header_len <= size:
                        head += f.read(header_len)
            header = parse_header(head, size, name)
        except FormatError as exc:
            self.error("safetensors-header", f"{exc}; re-download or re-convert this file", name)
            return
        except OSError as exc:
            self.error("read-error", f"cannot read {name}: {exc.strerror}", name)
            return
        raw = header.metadata.get(SAFETENSORS_ENCODINGS_KEY)
        try:
            encodings = json.loads(raw) if raw is not None else None
        except json.JSONDecodeError:
            encodings = None
        if not isinstance(encodings, dict):
            self.error("tensor-encoding", f"metadata {SAFETENSORS_ENCODINGS_KEY} is missing or not a JSON object", name)
            return
        stored = set(header.tensors)
        for tensor, desc in sorted(encodings.items()):
            stored.discard(tensor)
            stored.discard(tensor + SCALES_SUFFIX)
            self._register_tensor(name, role, tensor, desc, header.tensors)
        for leftover in sorted(stored):
            self.error("tensor-encoding", f"tensor {leftover!r} has no encoding entry in the metadata", name)

    def _register_tensor(self, file: str, role: str, tensor: str, desc: object, entries: dict) -> None:
        if tensor in self.tensors:
            self.error("tensor-duplicate", f"tensor {tensor!r} is stored in both {self.tensors[tensor].file} and {file}", file)
            return
        if not isinstance(desc, dict) or desc.get("encoding") not in Encoding.ALL or not isinstance(desc.get("shape"), list):
            self.error("tensor-encoding", f"malformed or unknown encoding entry for tensor {tensor!r}: {desc!r}", file)
            return
        encoding = desc["encoding"]
        shape = tuple(desc["shape"])
        if not all(_is_int(d) and d >= 0 for d in shape):
            self.error("tensor-encoding", f"tensor {tensor!r} has an invalid logical shape {list(shape)}", file)
            return
        try:
            layout = stored_layout(encoding, shape)
        except ColibriError as exc:  # QuantizationError for impossible shapes
            self.error("tensor-encoding", f"tensor {tensor!r}: {exc}", file)
            return
        segments = []
        for (dtype, seg_shape), stored_name in zip(layout, (tensor, tensor + SCALES_SUFFIX)):
            entry = entries.get(stored_name)
            if entry is None:
                self.error("tensor-encoding", f"tensor {stored_name!r} (part of {encoding} {tensor!r}) is missing", file)
                return
            if DTYPES[entry.dtype] != np.dtype(dtype).newbyteorder("<") or entry.shape != tuple(seg_shape):
                self.error(
                    "tensor-dtype",
                    f"tensor {stored_name!r} is stored as {entry.dtype}{list(entry.shape)}, but {encoding} of logical "
                    f"shape {list(shape)} needs {dtype}{list(seg_shape)}",
                    file,
                )
                return
            segments.append((stored_name, entry.begin, entry.end, dtype))
        self.tensors[tensor] = _Tensor(file, role, encoding, shape, tuple(segments))
        self.report.tensors_checked += 1

    def _check_tensor_shapes(self) -> None:
        """Shapes and encodings of the tensors whose shape the config fixes, by their Hugging Face names."""
        d = self.dims
        assert d is not None
        max_layer = d.layers + d.mtp_layers
        for name, t in sorted(self.tensors.items()):
            expected = _expected_shape(name, d)
            if expected is not None and list(t.shape) != expected:
                self.error("tensor-shape", f"tensor {name!r} has shape {list(t.shape)}, config.json implies {expected}", t.file)
            m = re.search(r"(?:^|\.)layers\.(\d+)\.", name)
            if m and int(m.group(1)) >= max_layer:
                self.error(
                    "tensor-shape",
                    f"tensor {name!r} belongs to layer {m.group(1)}, but the config has {d.layers} layers "
                    f"and {d.mtp_layers} MTP layers",
                    t.file,
                )
            leaf = name.rsplit(".", 2)
            is_small = len(t.shape) == 1 or name.endswith(("e_score_correction_bias", "mlp.gate.weight",
                                                            "block_sparse_moe.gate.weight"))
            if is_small and t.encoding in Encoding.QUANTIZED:
                self.error(
                    "tensor-dtype",
                    f"tensor {name!r} ({leaf[-1]}) is {t.encoding}; norms, routers and biases must stay f32",
                    t.file,
                )
            if t.role == "mtp" and t.encoding == Encoding.INT4_GS64:
                self.warn(
                    "tensor-dtype",
                    f"MTP tensor {name!r} is int4: int4 MTP heads drop draft acceptance to a few percent; "
                    "re-convert with MTP at int8",
                    t.file,
                )

    # --- experts --------------------------------------------------------------------------------------------------

    def _check_expert_headers(self) -> None:
        for name in sorted(n for n, i in self.files.items() if i["role"] == "experts"):
            if name not in self.sizes:
                continue
            try:
                with open(self.path / name, "rb") as f:
                    check_expert_file_header(f.read(EXPERT_FILE_HEADER_SIZE), name)
            except FormatError as exc:
                self.error("expert-header", str(exc), name)
                continue
            if self.sizes[name] < EXPERT_FILE_HEADER_SIZE:
                self.error("expert-header", f"{name} is shorter than its {EXPERT_FILE_HEADER_SIZE}-byte header", name)
                continue
            self.good_expert_files.add(name)

    def _read_index(self) -> dict | None:
        import pyarrow as pa

        if EXPERT_INDEX_NAME not in self.sizes:
            return None
        raw = (self.path / EXPERT_INDEX_NAME).read_bytes()
        if hashlib.sha256(raw).hexdigest() != self.files[EXPERT_INDEX_NAME]["sha256"]:
            self.error("index-checksum", f"{EXPERT_INDEX_NAME} does not match its sha256 in the manifest", EXPERT_INDEX_NAME)
        try:
            table = pa.ipc.open_file(pa.BufferReader(raw)).read_all()
            table.validate(full=True)
        except (pa.ArrowException, OSError, ValueError) as exc:
            self.error("index-invalid", f"{EXPERT_INDEX_NAME} is not a readable Arrow IPC file ({exc})", EXPERT_INDEX_NAME)
            return None
        cols = {}
        for column, kind in INDEX_COLUMNS.items():
            if column not in table.column_names or str(table.schema.field(column).type) != kind:
                self.error("index-invalid", f"index column {column!r} is missing or not of type {kind}", EXPERT_INDEX_NAME)
                return None
            cols[column] = table.column(column).to_pylist()
        return cols

    def _check_index(self) -> None:
        experts = self.manifest["experts"]
        shapes = experts.get("shapes") or {}
        cols = self._read_index()
        if cols is None:
            return
        n = len(cols["layer"])
        if _is_int(experts.get("records")) and n != experts["records"]:
            self.error("index-row", f"the index has {n} rows, the manifest says {experts['records']}", EXPERT_INDEX_NAME)
        if n and (not isinstance(shapes, dict) or set(shapes) != set(EXPERT_PARTS)):
            self.error("manifest-field", f"manifest experts.shapes must give {', '.join(EXPERT_PARTS)}", MANIFEST_NAME)
            return
        num_experts = experts.get("num_experts", 0) if _is_int(experts.get("num_experts")) else 0
        layers = set(experts.get("layers") or [])
        expert_files = {name for name, i in self.files.items() if i["role"] == "experts"}
        layouts: dict[tuple, RecordLayout | None] = {}
        seen: dict[tuple[int, int], int] = {}
        spans: dict[str, list[_Record]] = {}
        for i in range(n):
            layer, expert, file = cols["layer"][i], cols["expert"][i], cols["file"][i]
            where = f"index row {i} (layer {layer}, expert {expert})"
            if (layer, expert) in seen:
                self.error("index-duplicate", f"{where}: (layer, expert) already listed in row {seen[(layer, expert)]}", EXPERT_INDEX_NAME)
                continue
            seen[(layer, expert)] = i
            if layer not in layers or not 0 <= expert < num_experts:
                self.error("index-row", f"{where}: outside the manifest's expert layers or expert count {num_experts}", EXPERT_INDEX_NAME)
            if file not in expert_files:
                self.error("index-file", f"{where}: names {file!r}, which is not an expert data file of this container", EXPERT_INDEX_NAME)
                continue
            encodings = (cols["gate_encoding"][i], cols["up_encoding"][i], cols["down_encoding"][i])
            if encodings not in layouts:
                try:
                    if not all(e in Encoding.ALL for e in encodings):
                        raise FormatError(f"unknown encodings {encodings}")
                    layouts[encodings] = record_layout({k: tuple(v) for k, v in shapes.items()}, encodings)
                except (ColibriError, KeyError, TypeError, ValueError) as exc:
                    self.error("index-row", f"{where}: {exc}", EXPERT_INDEX_NAME)
                    layouts[encodings] = None
            layout = layouts[encodings]
            if layout is None:
                continue
            offset, length = cols["offset"][i], cols["length"][i]
            if length != layout.length:
                self.error("index-length", f"{where}: length {length}, but its shapes and encodings need {layout.length}", file)
                continue
            if offset < EXPERT_FILE_HEADER_SIZE or offset % RECORD_ALIGNMENT:
                self.error("index-alignment", f"{where}: offset {offset} is not a {RECORD_ALIGNMENT}-aligned record offset after the header", file)
                continue
            size = self.sizes.get(file, self.files[file]["size"])
            if offset + length > size:
                self.error(
                    "index-bounds",
                    f"{where}: record ends at byte {offset + length}, past the end of {file} ({size} bytes); "
                    "the data file is truncated or the index is wrong",
                    file,
                )
                continue
            rec = _Record(layer, expert, file, offset, length, cols["crc32"][i], layout)
            spans.setdefault(file, []).append(rec)
        for file in sorted(expert_files):
            recs = sorted(spans.get(file, []), key=lambda r: r.offset)
            self._check_file_layout(file, recs)
            self.records.extend(recs)
        self.report.records_checked = len(self.records)

    def _check_file_layout(self, file: str, recs: list[_Record]) -> None:
        """Records tile the file: header, then each record padded to the alignment, nothing in between or after."""
        if file not in self.sizes:
            return
        cursor = EXPERT_FILE_HEADER_SIZE
        prev = None
        for r in recs:
            if r.offset < cursor and prev is not None:
                self.error(
                    "index-overlap",
                    f"records of experts ({prev.layer}, {prev.expert}) and ({r.layer}, {r.expert}) overlap "
                    f"(bytes {r.offset}..{min(cursor, r.offset + r.length)})",
                    file,
                )
            elif r.offset > cursor:
                self.error(
                    "index-hole",
                    f"{r.offset - cursor} unindexed bytes at {cursor}..{r.offset} before expert ({r.layer}, {r.expert})",
                    file,
                )
            end = round_up(r.offset + r.length, RECORD_ALIGNMENT)
            if prev is None or end > cursor:
                cursor, prev = end, r
        size = self.sizes[file]
        if not recs:
            self.warn("index-hole", f"{file} holds no indexed record", file)
        elif size > cursor:
            self.error("index-hole", f"{size - cursor} unindexed bytes after the last record ({cursor}..{size})", file)

    def _check_completeness(self) -> None:
        experts = self.manifest["experts"]
        layers = experts.get("layers") or []
        num_experts = experts.get("num_experts", 0) if _is_int(experts.get("num_experts")) else 0
        d = self.dims
        if d is not None:
            shapes = experts.get("shapes") or {}
            want = d.expected_expert_shapes()
            if want and shapes and {k: list(v) for k, v in shapes.items()} != want:
                self.error(
                    "expert-shape",
                    f"expert shapes {shapes} disagree with config.json (moe_intermediate_size {d.moe_intermediate}, "
                    f"hidden_size {d.hidden}): expected {want}",
                    MANIFEST_NAME,
                )
            if d.num_experts and num_experts and num_experts != d.num_experts:
                self.error("expert-layers", f"manifest says {num_experts} experts per layer, config.json {d.num_experts}", MANIFEST_NAME)
            mtp = set(range(d.layers, d.layers + d.mtp_layers))
            missing_layers = sorted(set(d.moe_layers) - set(layers))
            if missing_layers:
                self.error(
                    "expert-layers",
                    f"config.json implies MoE layers {_ranges(missing_layers)} that the container has no experts for",
                    MANIFEST_NAME,
                )
            extra = sorted(set(layers) - set(d.moe_layers) - mtp)
            if extra:
                self.error("expert-layers", f"experts stored for layers {_ranges(extra)}, which config.json says are dense", MANIFEST_NAME)
        have = {(r.layer, r.expert) for r in self.records if r.file in self.good_expert_files}
        missing = [(layer, e) for layer in layers for e in range(num_experts) if (layer, e) not in have]
        if missing:
            shown = ", ".join(f"({layer}, {e})" for layer, e in missing[:8])
            self.error(
                "expert-missing",
                f"{len(missing)} of {len(layers) * num_experts} experts have no usable record: {shown}"
                f"{' ...' if len(missing) > 8 else ''}",
                EXPERT_INDEX_NAME,
            )

    # --- deep: every byte ---------------------------------------------------------------------------------------

    def _scan_payloads(self) -> None:
        by_file: dict[str, list] = {}
        for t in self.tensors.values():
            for stored_name, begin, end, dtype in t.segments:
                if dtype in ("float16", "float32", "uint16") and (stored_name.endswith(SCALES_SUFFIX) or t.encoding
                                                                  not in Encoding.QUANTIZED):
                    bits = t.encoding == Encoding.BF16
                    by_file.setdefault(t.file, []).append(_FiniteCheck(begin, end, "bf16" if bits else dtype, f"tensor {stored_name!r}"))
        for r in self.records:
            checks = by_file.setdefault(r.file, [])
            checks.append(_CrcCheck(r.offset, r.offset + r.length, r.crc32, (r.layer, r.expert)))
            for part in r.layout.parts:
                for k, seg in enumerate(part.segments):
                    scales = k == 1
                    if scales or part.encoding not in Encoding.QUANTIZED:
                        kind = "bf16" if part.encoding == Encoding.BF16 else seg.dtype
                        what = f"expert ({r.layer}, {r.expert}) {part.name} {'scales' if scales else 'weights'}"
                        checks.append(_FiniteCheck(r.offset + seg.offset, r.offset + seg.offset + seg.nbytes, kind, what))
        names = sorted(self.sizes)
        sweeps = {name: _Sweep(by_file.get(name, [])) for name in names}
        start = time.perf_counter()
        hashed = None
        if self.crc_only:  # expert data files are checked record by record; every other file still by sha256
            hashed = {self.path / n for n in names if self.files[n]["role"] != "experts"}
        results = scan_files([(self.path / n, sweeps[n].feed) for n in names], progress=self.progress, jobs=self.jobs,
                             hash_sha256=hashed,
                             chunk_bytes=self.chunk_bytes)
        self.report.read_seconds = time.perf_counter() - start
        for name, res in zip(names, results):
            self.report.bytes_read += res.nbytes
            if res.error:
                self.error("read-error", f"{name}: {res.error}; the drive may be failing", name)
                continue
            if res.sha256 is not None and res.sha256 != self.files[name]["sha256"]:
                self.error(
                    "file-sha256",
                    f"{name}: sha256 {res.sha256[:16]}... does not match the manifest's {self.files[name]['sha256'][:16]}...; "
                    "the bytes on disk are not the bytes written: re-download or re-convert it",
                    name,
                )
            for check in sweeps[name].finished:
                check.report(self, name)


class _CrcCheck:
    def __init__(self, begin: int, end: int, expected: int, key: tuple[int, int]):
        self.begin, self.end, self.expected, self.key = begin, end, expected, key
        self.state = 0

    def feed(self, view: memoryview) -> None:
        self.state = zlib.crc32(view, self.state)

    def report(self, v: _Verifier, file: str) -> None:
        if self.state & 0xFFFFFFFF != self.expected:
            v.error(
                "record-crc",
                f"record of expert {self.key} fails its crc32 check (bytes {self.begin}..{self.end}); "
                "the data file is corrupt: re-download or re-convert it",
                file,
            )


class _FiniteCheck:
    def __init__(self, begin: int, end: int, kind: str, what: str):
        self.begin, self.end, self.kind, self.what = begin, end, kind, what
        self.itemsize = 4 if kind == "float32" else 2
        self.carry = b""
        self.bad = 0

    def _count(self, raw) -> None:
        if self.kind == "bf16":
            bits = np.frombuffer(raw, dtype="<u2")
            self.bad += int(np.count_nonzero((bits & 0x7F80) == 0x7F80))
        else:
            a = np.frombuffer(raw, dtype=np.dtype(self.kind).newbyteorder("<"))
            if not np.isfinite(a).all():
                self.bad += int(a.size - np.count_nonzero(np.isfinite(a)))

    def feed(self, view: memoryview) -> None:
        if self.carry:
            need = self.itemsize - len(self.carry)
            self.carry += bytes(view[:need])
            view = view[need:]
            if len(self.carry) < self.itemsize:
                return
            self._count(self.carry)
            self.carry = b""
        usable = len(view) - len(view) % self.itemsize
        if usable:
            self._count(view[:usable])
        self.carry = bytes(view[usable:])

    def report(self, v: _Verifier, file: str) -> None:
        if self.bad:
            v.error("non-finite", f"{self.what}: {self.bad} NaN or infinite values; the weights are unusable: re-convert", file)


class _Sweep:
    """Feeds each chunk of a file to the checks whose byte ranges it covers (checks sorted by start)."""

    def __init__(self, checks: list):
        self.pending = sorted(checks, key=lambda c: c.begin)
        self.next = 0
        self.active: list = []
        self.finished: list = []

    def feed(self, pos: int, view: memoryview) -> None:
        end = pos + len(view)
        while self.next < len(self.pending) and self.pending[self.next].begin < end:
            self.active.append(self.pending[self.next])
            self.next += 1
        still = []
        for c in self.active:
            lo, hi = max(c.begin, pos), min(c.end, end)
            if hi > lo:
                c.feed(view[lo - pos : hi - pos])
            if c.end <= end:
                self.finished.append(c)
            else:
                still.append(c)
        self.active = still


# --- helpers ----------------------------------------------------------------------------------------------------


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _ranges(values: list[int]) -> str:
    out, start, prev = [], None, None
    for v in values:
        if start is None:
            start = prev = v
        elif v == prev + 1:
            prev = v
        else:
            out.append(f"{start}-{prev}" if prev != start else str(start))
            start = prev = v
    if start is not None:
        out.append(f"{start}-{prev}" if prev != start else str(start))
    return ", ".join(out)


def _expected_shape(name: str, d: ModelDims) -> list[int] | None:
    """The logical shape config.json fixes for a tensor name, where that is cheap to know."""
    if d.vocab and d.hidden and name in ("model.embed_tokens.weight", "lm_head.weight"):
        return [d.vocab, d.hidden]
    if d.vocab and d.hidden and name.endswith("shared_head.head.weight"):
        return [d.vocab, d.hidden]
    if d.hidden and (name == "model.norm.weight" or name.endswith(("input_layernorm.weight", "post_attention_layernorm.weight",
                                                                    "enorm.weight", "hnorm.weight", "shared_head.norm.weight"))):
        return [d.hidden]
    if d.hidden and name.endswith("eh_proj.weight"):
        return [d.hidden, 2 * d.hidden]
    if d.num_experts and d.hidden and name.endswith(("mlp.gate.weight", "block_sparse_moe.gate.weight")):
        return [d.num_experts, d.hidden]
    if d.num_experts and name.endswith("e_score_correction_bias"):
        return [d.num_experts]
    return None


def verify_container(
    path: Path | str,
    *,
    deep: bool = False,
    progress: Progress | None = None,
    jobs: int | None = None,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    crc_only: bool = False,
) -> VerifyReport:
    """Check a container and return every problem found. `progress(nbytes)` is called as deep verification reads.

    `crc_only` skips the sha256 of expert data files (every record's crc32 is still checked, and every other file's
    sha256): about twice as fast where sha256 bounds the speed (few or busy cores). crc32 finds corruption of the
    records, not deliberate changes, and not changes in the alignment padding between them.
    """
    return _Verifier(Path(path), deep, progress, jobs, chunk_bytes, crc_only).run()


def bytes_to_scan(path: Path | str) -> int:
    """Bytes deep verification reads (the size on disk of every file the manifest lists), for a progress total."""
    path = Path(path)
    try:
        manifest = json.loads((path / MANIFEST_NAME).read_bytes())
        total = 0
        for name in manifest.get("files", {}):
            try:
                check_file_name(name)
                total += (path / name).stat().st_size
            except (FormatError, OSError):
                pass
        return total
    except (OSError, ValueError, AttributeError):
        return 0
