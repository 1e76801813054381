"""Reading one source shard front to back on threads of its own, hashing it on the way.

`ShardReader` reads the shard sequentially in large reads (tensors grouped into batches of about `batch_bytes`; a
larger tensor is one read of its own) while the converter encodes what came before, so the disk never waits for the
encoder and the encoder rarely waits for the disk. Every byte is read exactly once, header included, and the shard's
sha256 is computed from those reads on a second thread (the data buffer of a valid safetensors file has no holes), so
the converter never reads a shard twice and hashing never stalls the disk. At most `depth` batches wait in the queue:
memory stays bounded whatever the shard size.

Reads bypass the page cache (O_DIRECT, 4096-aligned) where the filesystem allows it: a shard is read once, so caching
it only costs a copy per byte and evicts more useful pages. Where O_DIRECT is refused the reader falls back to
ordinary reads. Batch buffers are recycled: a buffer goes back into use once nothing refers to it any more (no array
view of it is alive, it is hashed), which spares the kernel from faulting in and zeroing fresh memory for every batch.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import queue
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from colibri_format.safetensors_io import DTYPES, SafetensorsHeader, TensorEntry

BATCH_BYTES = 64 * 1024 * 1024
QUEUE_DEPTH = 2
RING_BUFFERS = QUEUE_DEPTH + 4  # queued, being iterated or hashed, and still viewed by encodings in flight
ALIGN = 4096
_DONE = object()


def _batches(entries: list[TensorEntry], batch_bytes: int) -> list[list[TensorEntry]]:
    out: list[list[TensorEntry]] = []
    size = 0
    for e in entries:
        n = e.end - e.begin
        if not out or size + n > batch_bytes:
            out.append([])
            size = 0
        out[-1].append(e)
        size += n
    return out


def _aligned(owner: np.ndarray, nbytes: int) -> np.ndarray:
    """The first `nbytes` of `owner` from its first ALIGN-aligned address (owner has ALIGN bytes to spare)."""
    skip = -owner.ctypes.data % ALIGN
    return owner[skip : skip + nbytes]


def _read_into(fd: int, buf: memoryview, offset: int, need: int | None = None) -> None:
    """Fill `buf` from `offset`; with `need`, stop at end of file once `need` bytes are in."""
    done = 0
    while done < len(buf):
        n = os.preadv(fd, [buf[done:]], offset + done)
        if n <= 0:
            if need is not None and done >= need:
                return
            raise OSError(f"unexpected end of file at offset {offset + done}")
        done += n


class ShardReader:
    """Iterate (entry, array) over a shard's tensors in file order; `sha256()` once iteration is complete."""

    def __init__(self, path: Path, header: SafetensorsHeader, *, batch_bytes: int = BATCH_BYTES,
                 depth: int = QUEUE_DEPTH):
        self.path = Path(path)
        self.entries = sorted(header.tensors.values(), key=lambda e: e.begin)
        self._data_start = header.data_start
        self._batches = _batches(self.entries, batch_bytes)
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._hash = hashlib.sha256()
        self._error: BaseException | None = None
        self._stop = threading.Event()
        self._batch_bytes = batch_bytes
        self._ring: list[np.ndarray] = []
        self._file_size_aligned = -(-self.path.stat().st_size // ALIGN) * ALIGN
        self._fd = os.open(self.path, os.O_RDONLY)
        with contextlib.suppress(AttributeError, OSError):
            os.posix_fadvise(self._fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
        self._direct_fd = self._open_direct()
        self._hash_queue: queue.Queue = queue.Queue()
        self._hasher = threading.Thread(target=self._hash_all, name="colibri-shard-hasher", daemon=True)
        self._hasher.start()
        self._thread = threading.Thread(target=self._run, name="colibri-shard-reader", daemon=True)
        self._thread.start()

    def _open_direct(self) -> int | None:
        flag = getattr(os, "O_DIRECT", 0)
        if not flag:
            return None
        try:
            return os.open(self.path, os.O_RDONLY | flag)
        except OSError:
            return None

    def _hash_all(self) -> None:
        while True:
            item = self._hash_queue.get()
            if item is None:
                return
            self._hash.update(item)

    def _read_range(self, begin: int, end: int) -> np.ndarray | None:
        """The bytes [begin, end) of the shard, in a ring buffer (or a buffer of their own if larger)."""
        lo = begin - begin % ALIGN
        hi = min(-(-end // ALIGN) * ALIGN, self._file_size_aligned)
        buf = self._buffer(hi - lo)
        if buf is None:
            return None
        if self._direct_fd is not None:
            try:
                _read_into(self._direct_fd, memoryview(buf), lo, need=end - lo)
                return buf[begin - lo : end - lo]
            except OSError:
                os.close(self._direct_fd)  # refused (filesystem, alignment): plain reads from here on
                self._direct_fd = None
        _read_into(self._fd, memoryview(buf)[begin - lo : end - lo], begin)
        return buf[begin - lo : end - lo]

    def _run(self) -> None:
        try:
            head = bytearray(self._data_start)
            _read_into(self._fd, memoryview(head), 0)
            self._hash_queue.put(head)
            for batch in self._batches:
                if self._stop.is_set():
                    return
                begin, end = batch[0].begin, batch[-1].end
                buf = self._read_range(begin, end) if end > begin else np.empty(0, dtype=np.uint8)
                if buf is None:
                    return
                self._hash_queue.put(buf)
                self._put((begin, buf, batch))
                del buf
        except BaseException as exc:
            self._error = exc
        finally:
            self._hash_queue.put(None)
            self._put(_DONE)

    def _buffer(self, nbytes: int) -> np.ndarray | None:
        """A buffer of `nbytes` from the ring (waiting for one to be released), or a new one for a large tensor."""
        if nbytes > self._batch_bytes + 2 * ALIGN:
            return _aligned(np.empty(nbytes + ALIGN, dtype=np.uint8), nbytes)
        while not self._stop.is_set():
            for i in range(len(self._ring)):
                # Every view of a ring buffer refers to it (numpy views point at the array owning the memory), so
                # the ring's own reference and getrefcount's argument are all that is left once it is free.
                if sys.getrefcount(self._ring[i]) == 2:
                    return _aligned(self._ring[i], nbytes)
            if len(self._ring) < RING_BUFFERS:
                self._ring.append(np.empty(self._batch_bytes + 3 * ALIGN, dtype=np.uint8))
                return _aligned(self._ring[-1], nbytes)
            time.sleep(0.002)
        return None

    def _put(self, item) -> None:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return
            except queue.Full:
                continue

    def __iter__(self) -> Iterator[tuple[TensorEntry, np.ndarray]]:
        while True:
            item = self._queue.get()
            if item is _DONE:
                if self._error is not None:
                    raise self._error
                return
            begin, buf, batch = item
            for e in batch:
                dtype = DTYPES[e.dtype]
                raw = buf[e.begin - begin : e.end - begin]
                yield e, raw.view(dtype).reshape(e.shape) if raw.size else np.zeros(e.shape, dtype=dtype)

    def sha256(self) -> str:
        self._thread.join()
        self._hasher.join()
        if self._error is not None:
            raise self._error
        return self._hash.hexdigest()

    def close(self) -> None:
        self._stop.set()
        while True:  # unblock a reader waiting on a full queue
            try:
                self._queue.get_nowait()
            except queue.Empty:
                break
        self._thread.join()
        self._hasher.join()
        os.close(self._fd)
        if self._direct_fd is not None:
            os.close(self._direct_fd)
