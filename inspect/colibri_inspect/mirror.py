"""Mirrors: byte-identical, possibly partial copies of a container on other drives.

`verify_mirror` says which of the primary's files a mirror holds and whether each is byte-identical (size and
sha256 against the primary's manifest). `stage_mirror` makes one: it copies each file to NAME.partial while hashing
the source, fsyncs, drops the copy from the page cache and hashes it again from the drive, and only then renames it
into place. Files already present and verified are skipped, so an interrupted staging resumes where it stopped; a
small state file (`.colibri-mirror.json`, keyed by size and mtime) spares re-hashing what a previous run verified.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from colibri_format.constants import EXPERT_INDEX_NAME, MANIFEST_NAME
from colibri_format.errors import ColibriError, IntegrityError
from colibri_format.reader import load_manifest

from .scan import Progress, drop_page_cache, scan_file, scan_files

STATE_NAME = ".colibri-mirror.json"
DESCRIBING_FILES = (MANIFEST_NAME, EXPERT_INDEX_NAME, "config.json")


@dataclass(frozen=True)
class MirrorFile:
    name: str
    role: str
    size: int
    status: str  # "identical", "missing", "size-mismatch", "sha256-mismatch", "read-error"
    detail: str = ""


@dataclass
class MirrorReport:
    primary: Path
    mirror: Path
    files: list[MirrorFile] = field(default_factory=list)
    manifest_matches: bool | None = None  # None: the mirror carries no manifest
    records_total: int = 0
    records_held: int = 0

    @property
    def corrupt(self) -> list[MirrorFile]:
        return [f for f in self.files if f.status not in ("identical", "missing")]

    @property
    def data_files(self) -> list[MirrorFile]:
        return [f for f in self.files if f.role == "experts"]

    @property
    def status(self) -> str:
        if self.corrupt or self.manifest_matches is False:
            return "corrupt"
        held = [f for f in self.data_files if f.status == "identical"]
        if not held:
            return "empty"
        if all(f.status == "identical" for f in self.files):
            return "full"
        return "partial"

    @property
    def ok(self) -> bool:
        return self.status in ("full", "partial")

    @property
    def bytes_held(self) -> int:
        return sum(f.size for f in self.data_files if f.status == "identical")

    @property
    def bytes_total(self) -> int:
        return sum(f.size for f in self.data_files)

    def to_json(self) -> dict:
        return {
            "mirror": str(self.mirror),
            "status": self.status,
            "manifest_matches": self.manifest_matches,
            "expert_bytes_held": self.bytes_held,
            "expert_bytes_total": self.bytes_total,
            "records_held": self.records_held,
            "records_total": self.records_total,
            "files": [f.__dict__ for f in self.files],
        }


def _records_per_file(primary: Path) -> dict[str, int]:
    import pyarrow as pa

    try:
        table = pa.ipc.open_file(pa.memory_map(str(primary / EXPERT_INDEX_NAME))).read_all()
    except (OSError, pa.ArrowException):
        return {}
    counts: dict[str, int] = {}
    for name in table.column("file").to_pylist():
        counts[name] = counts.get(name, 0) + 1
    return counts


def verify_mirror(primary: Path, mirror: Path, *, progress: Progress | None = None, jobs: int | None = None) -> MirrorReport:
    """Compare every file the primary's manifest lists with the mirror's copy (size, then sha256)."""
    primary, mirror = Path(primary), Path(mirror)
    manifest = load_manifest(primary)
    report = MirrorReport(primary, mirror)
    mirror_manifest = mirror / MANIFEST_NAME
    if mirror_manifest.is_file():
        try:
            report.manifest_matches = load_manifest(mirror)["fingerprint"] == manifest["fingerprint"]
        except ColibriError:
            report.manifest_matches = False
    to_hash = []
    entries = {}
    for name, info in sorted(manifest["files"].items()):
        p = mirror / name
        if not p.is_file():
            entries[name] = MirrorFile(name, info["role"], info["size"], "missing")
            continue
        size = p.stat().st_size
        if size != info["size"]:
            entries[name] = MirrorFile(name, info["role"], info["size"], "size-mismatch", f"{size} bytes, primary {info['size']}")
            continue
        to_hash.append(name)
    results = scan_files([(mirror / n, None) for n in to_hash], progress=progress, jobs=jobs)
    for name, res in zip(to_hash, results):
        info = manifest["files"][name]
        if res.error:
            entries[name] = MirrorFile(name, info["role"], info["size"], "read-error", res.error)
        elif res.sha256 != info["sha256"]:
            entries[name] = MirrorFile(name, info["role"], info["size"], "sha256-mismatch", f"sha256 {res.sha256[:16]}...")
        else:
            entries[name] = MirrorFile(name, info["role"], info["size"], "identical")
    report.files = [entries[n] for n in sorted(entries)]
    per_file = _records_per_file(primary)
    report.records_total = sum(per_file.values())
    report.records_held = sum(per_file.get(f.name, 0) for f in report.data_files if f.status == "identical")
    return report


def mirror_bytes_to_hash(primary: Path, mirror: Path) -> int:
    manifest = load_manifest(primary)
    total = 0
    for name, info in manifest["files"].items():
        p = Path(mirror) / name
        if p.is_file() and p.stat().st_size == info["size"]:
            total += info["size"]
    return total


# --- staging --------------------------------------------------------------------------------------------------


@dataclass
class StageReport:
    mirror: Path
    planned: list[str] = field(default_factory=list)
    copied: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    bytes_copied: int = 0
    bytes_planned: int = 0

    def to_json(self) -> dict:
        return {
            "mirror": str(self.mirror),
            "planned": self.planned,
            "copied": self.copied,
            "skipped": self.skipped,
            "bytes_copied": self.bytes_copied,
            "bytes_planned": self.bytes_planned,
        }


def choose_hot_files(
    expert_files: dict[str, int], file_mass: dict[str, float], budget_bytes: int
) -> list[str]:
    """Expert data files to stage under a byte budget: densest routing mass per byte first, greedily."""
    order = sorted(expert_files, key=lambda n: (-file_mass.get(n, 0.0) / max(1, expert_files[n]), n))
    chosen, used = [], 0
    for name in order:
        if file_mass.get(name, 0.0) <= 0:
            continue
        if used + expert_files[name] <= budget_bytes:
            chosen.append(name)
            used += expert_files[name]
    return sorted(chosen)


def plan_stage(primary: Path, hot_only_bytes: int | None = None, file_mass: dict[str, float] | None = None) -> list[str]:
    """The files a mirror staging copies: everything, or the describing files plus the hottest expert data files."""
    manifest = load_manifest(primary)
    files = manifest["files"]
    if hot_only_bytes is None:
        return sorted(n for n in files) + [MANIFEST_NAME]
    if not file_mass:
        raise ColibriError(
            "--hot-only needs the container's usage history (.coli_usage), which it does not have yet: "
            "run the model for a while first, or stage the whole container"
        )
    expert_files = {n: i["size"] for n, i in files.items() if i["role"] == "experts"}
    describing = [n for n in DESCRIBING_FILES if n in files]
    return sorted(describing + choose_hot_files(expert_files, file_mass, hot_only_bytes)) + [MANIFEST_NAME]


def _load_state(mirror: Path, fingerprint: str) -> dict:
    try:
        state = json.loads((mirror / STATE_NAME).read_text())
        if state.get("fingerprint") == fingerprint and isinstance(state.get("files"), dict):
            return state
    except (OSError, ValueError):
        pass
    return {"fingerprint": fingerprint, "files": {}}


def _save_state(mirror: Path, state: dict) -> None:
    tmp = mirror / (STATE_NAME + ".tmp")
    tmp.write_text(json.dumps(state, indent=1, sort_keys=True))
    os.replace(tmp, mirror / STATE_NAME)


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _stat_key(p: Path) -> list[int]:
    st = p.stat()
    return [st.st_size, st.st_mtime_ns]


def _already_verified(path: Path, size: int, sha256: str, state: dict, name: str) -> bool:
    if not path.is_file() or path.stat().st_size != size:
        return False
    known = state["files"].get(name)
    if known and known.get("stat") == _stat_key(path) and known.get("sha256") == sha256:
        return True
    res = scan_file(path)
    if res.sha256 == sha256:
        state["files"][name] = {"stat": _stat_key(path), "sha256": sha256}
        return True
    return False


def _copy_verified(src: Path, dst: Path, size: int, sha256: str, progress: Progress | None) -> None:
    partial = dst.with_name(dst.name + ".partial")
    with open(partial, "wb") as out:
        res = scan_file(src, on_chunk=lambda pos, view: out.write(view), progress=progress)
        out.flush()
        os.fsync(out.fileno())
    if res.error:
        partial.unlink(missing_ok=True)
        raise ColibriError(f"{src}: {res.error}")
    if res.nbytes != size or res.sha256 != sha256:
        partial.unlink(missing_ok=True)
        raise IntegrityError(
            f"{src} does not match the primary's manifest (sha256 or size); verify the primary before mirroring it"
        )
    drop_page_cache(partial)
    check = scan_file(partial)
    if check.sha256 != sha256:
        partial.unlink(missing_ok=True)
        raise IntegrityError(f"{partial}: the copy reads back differently from what was written; the drive is unreliable")
    os.replace(partial, dst)
    _fsync_dir(dst.parent)


def stage_mirror(
    primary: Path,
    mirror: Path,
    *,
    hot_only_bytes: int | None = None,
    file_mass: dict[str, float] | None = None,
    progress: Progress | None = None,
    on_file_done: Callable[[str], None] | None = None,
) -> StageReport:
    """Copy (part of) a container to `mirror`, verified and atomically per file; rerun to resume."""
    primary, mirror = Path(primary), Path(mirror)
    manifest = load_manifest(primary)
    names = plan_stage(primary, hot_only_bytes, file_mass)
    mirror.mkdir(parents=True, exist_ok=True)
    state = _load_state(mirror, manifest["fingerprint"])
    report = StageReport(mirror, planned=names)
    manifest_bytes = (primary / MANIFEST_NAME).read_bytes()
    for name in names:
        if name == MANIFEST_NAME:
            continue
        info = manifest["files"][name]
        report.bytes_planned += info["size"]
        dst = mirror / name
        if _already_verified(dst, info["size"], info["sha256"], state, name):
            report.skipped.append(name)
            if progress is not None:
                progress(info["size"])
        else:
            _copy_verified(primary / name, dst, info["size"], info["sha256"], progress)
            state["files"][name] = {"stat": _stat_key(dst), "sha256": info["sha256"]}
            report.copied.append(name)
            report.bytes_copied += info["size"]
        _save_state(mirror, state)
        if on_file_done is not None:
            on_file_done(name)
    # The manifest goes last, so a mirror only describes itself once its files are in place.
    target = mirror / MANIFEST_NAME
    if not target.is_file() or target.read_bytes() != manifest_bytes:
        tmp = target.with_name(MANIFEST_NAME + ".partial")
        with open(tmp, "wb") as f:
            f.write(manifest_bytes)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
        _fsync_dir(mirror)
        report.copied.append(MANIFEST_NAME)
    else:
        report.skipped.append(MANIFEST_NAME)
    return report


def file_usage_mass(records_per_file: dict[str, list[tuple[int, int]]], layers: tuple[int, ...], counts) -> dict[str, float]:
    """Routing mass of the records each expert data file holds."""
    row = {layer: r for r, layer in enumerate(layers)}
    out = {}
    for name, keys in records_per_file.items():
        out[name] = float(sum(counts[row[layer], expert] for layer, expert in keys if layer in row))
    return out
