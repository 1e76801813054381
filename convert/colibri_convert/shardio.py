"""Reading one source shard front to back on a thread of its own, hashing it on the way.

`ShardReader` reads the shard sequentially in large reads (tensors grouped into batches of about `batch_bytes`; a
larger tensor is one read of its own) while the converter encodes what came before, so the disk never waits for the
encoder and the encoder rarely waits for the disk. Every byte is read exactly once, header included, and the shard's
sha256 is computed from those reads (the data buffer of a valid safetensors file has no holes), so the converter no
longer reads a shard twice. At most `depth` batches wait in the queue: memory stays bounded whatever the shard size.
"""

from __future__ import annotations

import hashlib
import os
import queue
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from colibri_format.safetensors_io import DTYPES, SafetensorsHeader, TensorEntry

BATCH_BYTES = 64 * 1024 * 1024
QUEUE_DEPTH = 2
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


def _read_into(fd: int, buf: memoryview, offset: int) -> None:
    done = 0
    while done < len(buf):
        n = os.preadv(fd, [buf[done:]], offset + done)
        if n <= 0:
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
        self._fd = os.open(self.path, os.O_RDONLY)
        try:
            os.posix_fadvise(self._fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
        except (AttributeError, OSError):
            pass
        self._thread = threading.Thread(target=self._run, name="colibri-shard-reader", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            head = bytearray(self._data_start)
            _read_into(self._fd, memoryview(head), 0)
            self._hash.update(head)
            for batch in self._batches:
                if self._stop.is_set():
                    return
                begin, end = batch[0].begin, batch[-1].end
                buf = np.empty(end - begin, dtype=np.uint8)
                if end > begin:
                    _read_into(self._fd, memoryview(buf), begin)
                    self._hash.update(buf)
                self._put((begin, buf, batch))
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer
            self._error = exc
        finally:
            self._put(_DONE)

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
        os.close(self._fd)
