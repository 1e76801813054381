"""Reading expert records from drives: buffered or O_DIRECT reads, mirrors, a bounded pool of reader threads.

`RecordReader.read(layer, expert)` returns the record's payload in a buffer of its own (page-aligned when O_DIRECT is
on) plus the drive it came from. Each expert is assigned to exactly one drive by a deterministic hash weighted by the
drives' bandwidths, so a prefetch and a demand read of the same expert always hit the same drive. A mirror whose file
fails verification at start is not used; a read error on a mirror falls back to the primary with one warning.
"""

from __future__ import annotations

import mmap
import os
import threading
import time
import warnings
import zlib
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from colibri_format.constants import EXPERT_FILE_HEADER_SIZE, RECORD_ALIGNMENT
from colibri_format.errors import IntegrityError
from colibri_format.records import check_expert_file_header, record_crc32

O_DIRECT = getattr(os, "O_DIRECT", 0)
MIRROR_SAMPLE_RECORDS = 4


@dataclass
class Drive:
    """One copy of (some of) the container's expert data files: the primary or a mirror."""

    name: str
    root: Path
    files: set[str]
    weight: float = 1.0
    bytes_read: int = 0
    reads: int = 0
    read_seconds: float = 0.0
    failed: bool = False


@dataclass
class ReadResult:
    buffer: object  # bytes-like holding the payload first (may be longer: aligned padding)
    length: int
    drive: str
    seconds: float


@dataclass
class DriveReport:
    name: str
    files: int
    bytes_read: int
    reads: int
    read_seconds: float
    failed: bool


def allocate_buffer(size: int) -> mmap.mmap:
    """A page-aligned read buffer (O_DIRECT needs the alignment; buffered reads do not mind it)."""
    return mmap.mmap(-1, -(-size // RECORD_ALIGNMENT) * RECORD_ALIGNMENT)


def _weighted_choice(key: str, drives: list[Drive]) -> Drive:
    """Deterministic: the same key and drive set give the same drive in every process."""
    total = sum(d.weight for d in drives)
    point = (zlib.crc32(key.encode()) / 2**32) * total
    acc = 0.0
    for d in drives:
        acc += d.weight
        if point < acc:
            return d
    return drives[-1]


class RecordReader:
    """Reads expert records of one container from its primary directory and optional mirrors."""

    def __init__(
        self,
        container,
        mirrors: list[Path] | None = None,
        direct: str = "off",
        drive_weights: list[float] | None = None,
        drop_page_cache: bool = False,
    ) -> None:
        self.container = container
        expert_files = set(container.files_of_role("experts"))
        self.drives = [Drive("primary", Path(container.path), expert_files)]
        for i, m in enumerate(mirrors or []):
            self.drives.append(Drive(f"mirror{i + 1}:{m}", Path(m), self._verify_mirror(Path(m), expert_files)))
        if drive_weights:
            if len(drive_weights) != len(self.drives):
                raise ValueError(
                    f"--disk-weights gives {len(drive_weights)} weights for {len(self.drives)} drives "
                    "(the primary first, then each mirror)"
                )
            for d, w in zip(self.drives, drive_weights):
                d.weight = float(w)
        self.direct = self._resolve_direct(direct)
        self.drop_page_cache = drop_page_cache and not self.direct
        self._fds: dict[tuple[str, str], int] = {}
        self._lock = threading.Lock()
        self._warned: set[str] = set()
        self._in_flight = 0
        self._busy_since = 0.0
        self.busy_seconds = 0.0  # wall time with at least one read in flight: achieved GB/s = bytes / busy

    # --- set-up ---------------------------------------------------------------------------------------------------

    def _verify_mirror(self, root: Path, expert_files: set[str]) -> set[str]:
        """The expert files this mirror holds intact: size, header and a sample of record checksums."""
        good: set[str] = set()
        manifest_files = self.container.manifest["files"]
        by_file: dict[str, list] = {}
        for _, _, loc in self.container.iter_records():
            by_file.setdefault(loc.file, []).append(loc)
        for name in sorted(expert_files):
            p = root / name
            try:
                if not p.is_file():
                    continue
                if p.stat().st_size != manifest_files[name]["size"]:
                    warnings.warn(f"mirror {root}: {name} has the wrong size; not using it", stacklevel=2)
                    continue
                with open(p, "rb") as f:
                    check_expert_file_header(f.read(EXPERT_FILE_HEADER_SIZE), str(p))
                    locs = by_file.get(name, [])
                    step = max(1, len(locs) // MIRROR_SAMPLE_RECORDS)
                    for loc in locs[::step][:MIRROR_SAMPLE_RECORDS]:
                        f.seek(loc.offset)
                        if record_crc32(f.read(loc.length)) != loc.crc32:
                            raise IntegrityError(f"{p}: sampled record fails its checksum")
                good.add(name)
            except (OSError, IntegrityError, Exception) as exc:  # a bad mirror is skipped, never fatal
                warnings.warn(f"mirror {root}: {name} is unusable ({exc}); reading it from the primary", stacklevel=2)
        return good

    def _resolve_direct(self, mode: str) -> bool:
        if mode not in ("on", "off", "auto"):
            raise ValueError(f"--direct must be on, off or auto, not {mode!r}")
        if mode == "off" or not O_DIRECT:
            if mode == "on" and not O_DIRECT:
                warnings.warn("O_DIRECT is not available on this platform; using buffered reads", stacklevel=2)
            return False
        supported = self._direct_supported()
        if mode == "on" and not supported:
            warnings.warn("the file system refuses O_DIRECT; using buffered reads", stacklevel=2)
        return supported

    def _direct_supported(self) -> bool:
        for name in sorted(self.drives[0].files)[:1]:
            try:
                fd = os.open(self.drives[0].root / name, os.O_RDONLY | O_DIRECT)
            except OSError:
                return False
            try:
                buf = mmap.mmap(-1, RECORD_ALIGNMENT)
                os.preadv(fd, [buf], 0)
                return True
            except OSError:
                return False
            finally:
                os.close(fd)
        return False

    # --- reading --------------------------------------------------------------------------------------------------

    def drive_for(self, layer: int, expert: int, file: str) -> Drive:
        candidates = [d for d in self.drives if file in d.files and not d.failed]
        if len(candidates) == 1:
            return candidates[0]
        return _weighted_choice(f"{layer}:{expert}", candidates)

    def _fd(self, drive: Drive, file: str) -> int:
        key = (drive.name, file)
        fd = self._fds.get(key)
        if fd is None:
            with self._lock:
                fd = self._fds.get(key)
                if fd is None:
                    flags = os.O_RDONLY | (O_DIRECT if self.direct else 0)
                    fd = os.open(drive.root / file, flags)
                    self._fds[key] = fd
        return fd

    def _begin_read(self) -> float:
        now = time.perf_counter()
        with self._lock:
            if self._in_flight == 0:
                self._busy_since = now
            self._in_flight += 1
        return now

    def _end_read(self) -> None:
        now = time.perf_counter()
        with self._lock:
            self._in_flight -= 1
            if self._in_flight == 0:
                self.busy_seconds += now - self._busy_since

    def _read_from(self, drive: Drive, file: str, offset: int, length: int, buf=None) -> ReadResult:
        fd = self._fd(drive, file)
        t0 = self._begin_read()
        try:
            return self._read_into_buffer(drive, fd, file, offset, length, t0, buf)
        finally:
            self._end_read()

    def _read_into_buffer(
        self, drive: Drive, fd: int, file: str, offset: int, length: int, t0: float, buf
    ) -> ReadResult:
        size = -(-length // RECORD_ALIGNMENT) * RECORD_ALIGNMENT
        if buf is None or len(buf) < size:
            buf = allocate_buffer(size)
        if self.direct:
            got = os.preadv(fd, [memoryview(buf)[:size]], offset)
        else:
            got = os.preadv(fd, [memoryview(buf)[:length]], offset)
            if self.drop_page_cache:
                os.posix_fadvise(fd, offset, length, os.POSIX_FADV_DONTNEED)
        if got < length:
            raise OSError(f"short read of {file} at {offset}: {got} of {length} bytes")
        seconds = time.perf_counter() - t0
        with self._lock:
            drive.bytes_read += length
            drive.reads += 1
            drive.read_seconds += seconds
        return ReadResult(buf, length, drive.name, seconds)

    def read(self, layer: int, expert: int, buffer=None) -> ReadResult:
        """Read one record into `buffer` (a page-aligned buffer from `allocate_buffer`, reused to spare the kernel
        from zeroing fresh pages on every read) or into a new one."""
        loc = self.container.record_location(layer, expert)
        drive = self.drive_for(layer, expert, loc.file)
        if drive is self.drives[0]:
            return self._read_from(drive, loc.file, loc.offset, loc.length, buffer)
        try:
            result = self._read_from(drive, loc.file, loc.offset, loc.length, buffer)
            if record_crc32(memoryview(result.buffer)[: loc.length]) != loc.crc32:
                raise OSError(f"record ({layer}, {expert}) read from {drive.name} fails its checksum")
            return result
        except OSError as exc:
            with self._lock:
                drive.files.discard(loc.file)
                if drive.name not in self._warned:
                    self._warned.add(drive.name)
                    warnings.warn(f"read error on {drive.name} ({exc}); falling back to the primary", stacklevel=2)
            return self._read_from(self.drives[0], loc.file, loc.offset, loc.length, buffer)

    def report(self) -> list[DriveReport]:
        return [DriveReport(d.name, len(d.files), d.bytes_read, d.reads, d.read_seconds, d.failed) for d in self.drives]

    def close(self) -> None:
        with self._lock:
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()


@dataclass
class IOPool:
    """A bounded pool of reader threads. pread/preadv release the GIL, so reads overlap with compute."""

    threads: int = 4
    _executor: ThreadPoolExecutor | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.threads < 1:
            raise ValueError("--io-threads must be at least 1")
        self._executor = ThreadPoolExecutor(max_workers=self.threads, thread_name_prefix="colibri-io")

    def submit(self, fn, *args) -> Future:
        return self._executor.submit(fn, *args)

    def shutdown(self) -> None:
        self._executor.shutdown(wait=True, cancel_futures=True)
