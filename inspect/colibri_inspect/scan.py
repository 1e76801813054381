"""Reading whole files at disk speed: large sequential chunks, hashing and checking on other threads.

A file is read in `chunk_bytes` pieces into a small ring of reusable buffers. While the reading thread waits on the
disk for chunk k+1, one thread feeds chunk k to sha256 (which must see the bytes in order) and another runs the
per-chunk checks (record crc32s, finite scales). hashlib and zlib.crc32 release the GIL on large buffers and numpy
does for its loops, so the three overlap on separate cores; several files are scanned at once by `scan_files`.

Also here: dropping a file from the page cache and measuring a drive's cold sequential read bandwidth.
"""

from __future__ import annotations

import hashlib
import os
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

DEFAULT_CHUNK_BYTES = 16 * 1024 * 1024
RING_BUFFERS = 4

Progress = Callable[[int], None]


def default_jobs() -> int:
    """Files scanned at once. Each keeps about two cores busy (sha256 and the record checks run beside the reads),
    and a fast NVMe wants several streams: half the cores, at most 8."""
    return max(1, min(8, (os.cpu_count() or 1) // 2))


def drop_page_cache(path: Path) -> bool:
    """Ask the kernel to forget the cached pages of `path` (clean pages only); False where unsupported."""
    if not hasattr(os, "posix_fadvise"):
        return False
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return False
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


@dataclass
class FileScan:
    """What scanning one file found: its sha256, bytes read, and an OSError message if reading failed."""

    path: Path
    sha256: str | None
    nbytes: int
    error: str | None = None


def scan_file(
    path: Path,
    *,
    on_chunk: Callable[[int, memoryview], None] | None = None,
    hash_sha256: bool = True,
    progress: Progress | None = None,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
) -> FileScan:
    """Read `path` once from start to end; hash it and pass every chunk, with its file offset, to `on_chunk`.

    `on_chunk` is called in file order from one thread, so it may keep state across chunks.
    """
    sha = hashlib.sha256() if hash_sha256 else None
    chunk_bytes = max(4096, min(chunk_bytes, -(-_size(path) // 4096) * 4096))
    buffers = [bytearray(chunk_bytes) for _ in range(RING_BUFFERS)]
    pending: deque = deque()
    pos = 0
    error = None
    with ThreadPoolExecutor(1) as hasher, ThreadPoolExecutor(1) as checker:
        try:
            with open(path, "rb", buffering=0) as f:
                if hasattr(os, "posix_fadvise"):
                    os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_SEQUENTIAL)
                k = 0
                while True:
                    if len(pending) == RING_BUFFERS:
                        for fut in pending.popleft():
                            fut.result()
                    buf = buffers[k % RING_BUFFERS]
                    n = f.readinto(buf)
                    if not n:
                        break
                    view = memoryview(buf)[:n]
                    futures = []
                    if sha is not None:
                        futures.append(hasher.submit(sha.update, view))
                    if on_chunk is not None:
                        futures.append(checker.submit(on_chunk, pos, view))
                    pending.append(futures)
                    pos += n
                    k += 1
                    if progress is not None:
                        progress(n)
        except OSError as exc:
            error = f"read failed at byte {pos}: {exc.strerror or exc}"
        finally:
            while pending:
                for fut in pending.popleft():
                    fut.result()
    return FileScan(Path(path), sha.hexdigest() if sha is not None and error is None else None, pos, error)


def scan_files(
    jobs_list: list[tuple[Path, Callable[[int, memoryview], None] | None]],
    *,
    hash_sha256: set[Path] | None = None,
    progress: Progress | None = None,
    jobs: int | None = None,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
) -> list[FileScan]:
    """Scan several files, `jobs` at a time, largest first; results in the order given. With `hash_sha256`, only
    the files in it are hashed."""
    jobs = jobs or default_jobs()
    order = sorted(range(len(jobs_list)), key=lambda i: -_size(jobs_list[i][0]))
    results: list[FileScan | None] = [None] * len(jobs_list)
    with ThreadPoolExecutor(jobs) as pool:
        futures = {
            pool.submit(
                scan_file,
                jobs_list[i][0],
                on_chunk=jobs_list[i][1],
                hash_sha256=hash_sha256 is None or jobs_list[i][0] in hash_sha256,
                progress=progress,
                chunk_bytes=chunk_bytes,
            ): i
            for i in order
        }
        for fut, i in futures.items():
            results[i] = fut.result()
    return results  # type: ignore[return-value]


def _size(path: Path) -> int:
    try:
        return Path(path).stat().st_size
    except OSError:
        return 0


@dataclass(frozen=True)
class Bandwidth:
    """A measured sequential read: bytes, seconds, and whether the page cache could be dropped first."""

    nbytes: int
    seconds: float
    cold: bool

    @property
    def gbps(self) -> float:
        return self.nbytes / self.seconds / 1e9 if self.seconds > 0 else 0.0


def measure_read_bandwidth(
    paths: list[Path], *, max_bytes: int | None = None, chunk_bytes: int = DEFAULT_CHUNK_BYTES, jobs: int = 1
) -> Bandwidth:
    """Cold sequential read bandwidth: drop each file from the page cache, then read (up to `max_bytes` in all)
    with large reads and no processing. `jobs` files are read at once (a fast NVMe needs a few streams)."""
    paths = [Path(p) for p in paths]
    dropped = [drop_page_cache(p) for p in paths]  # every file, no short cut
    cold = bool(dropped) and all(dropped)
    budget = [max_bytes if max_bytes is not None else sum(_size(p) for p in paths)]
    per_file = None if max_bytes is None else max(chunk_bytes, max_bytes // max(1, min(jobs, len(paths))))

    def read(path: Path) -> int:
        buf = bytearray(chunk_bytes)
        done = 0
        with open(path, "rb", buffering=0) as f:
            if hasattr(os, "posix_fadvise"):
                os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_SEQUENTIAL)
            while per_file is None or done < per_file:
                if budget[0] <= 0:
                    break
                n = f.readinto(buf)
                if not n:
                    break
                done += n
                budget[0] -= n
        return done

    start = time.perf_counter()
    with ThreadPoolExecutor(max(1, jobs)) as pool:
        total = sum(pool.map(read, paths))
    return Bandwidth(total, time.perf_counter() - start, cold)
