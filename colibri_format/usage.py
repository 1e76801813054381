"""The `.coli_usage` sidecar (specs/SIDECARS.md): decayed routing counts per (layer, expert), bound to one model.

The file is small and replaced atomically on every write (write a uniquely named temporary file, fsync, rename), so
a reader sees either the old or the new counts, never a torn mix, whatever number of writers race. A file that is
truncated, corrupt, of other dimensions or of another model is refused with a SidecarError; callers warn and start
from zero counts.
"""

from __future__ import annotations

import os
import struct
import tempfile
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .constants import USAGE_FILE_NAME, USAGE_MAGIC, USAGE_VERSION
from .errors import SidecarError

# magic, version, layers, experts, reserved, fingerprint (32 raw bytes), decay, turns
_HEADER = struct.Struct("<8sIIII32sdQ")
_CRC = struct.Struct("<I")
DEFAULT_DECAY = 0.98
MAX_USAGE_CELLS = 1 << 24


@dataclass
class UsageCounts:
    """Decayed routing counts: counts[layer, expert] for every layer slot of the model (dense layers stay zero)."""

    fingerprint: str
    counts: np.ndarray
    decay: float = DEFAULT_DECAY
    turns: int = 0
    _pending: np.ndarray | None = field(default=None, repr=False)

    @classmethod
    def empty(cls, fingerprint: str, layers: int, experts: int, decay: float = DEFAULT_DECAY) -> UsageCounts:
        return cls(fingerprint, np.zeros((layers, experts), dtype=np.float32), decay, 0)

    @property
    def dims(self) -> tuple[int, int]:
        return tuple(self.counts.shape)

    def add_turn(self, turn_counts: np.ndarray) -> None:
        """Fold one turn's raw routing counts in: counts = counts * decay + turn_counts."""
        turn_counts = np.asarray(turn_counts, dtype=np.float32)
        if turn_counts.shape != self.counts.shape:
            raise SidecarError(f"turn counts of shape {turn_counts.shape} do not match usage dims {self.counts.shape}")
        self.counts = (self.counts * np.float32(self.decay) + turn_counts).astype(np.float32)
        self.turns += 1

    def to_bytes(self) -> bytes:
        layers, experts = self.counts.shape
        header = _HEADER.pack(
            USAGE_MAGIC, USAGE_VERSION, layers, experts, 0, bytes.fromhex(self.fingerprint), self.decay, self.turns
        )
        body = header + np.ascontiguousarray(self.counts, dtype="<f4").tobytes()
        return body + _CRC.pack(zlib.crc32(body) & 0xFFFFFFFF)

    @classmethod
    def from_bytes(
        cls, data: bytes, *, expect_fingerprint: str | None = None, expect_dims: tuple[int, int] | None = None
    ) -> UsageCounts:
        if len(data) < _HEADER.size + _CRC.size:
            raise SidecarError(f"usage file is truncated ({len(data)} bytes)")
        magic, version, layers, experts, _, fp, decay, turns = _HEADER.unpack_from(data)
        if magic != USAGE_MAGIC:
            raise SidecarError("not a .coli_usage file (bad magic)")
        if version != USAGE_VERSION:
            raise SidecarError(f"usage file version {version} is not supported (expected {USAGE_VERSION})")
        if layers * experts > MAX_USAGE_CELLS:
            raise SidecarError(f"usage file declares absurd dimensions {layers} x {experts}")
        expected = _HEADER.size + 4 * layers * experts + _CRC.size
        if len(data) != expected:
            raise SidecarError(f"usage file has {len(data)} bytes, its header implies {expected} (truncated?)")
        (crc,) = _CRC.unpack_from(data, expected - _CRC.size)
        if zlib.crc32(data[: expected - _CRC.size]) & 0xFFFFFFFF != crc:
            raise SidecarError("usage file fails its checksum (corrupt)")
        fingerprint = fp.hex()
        if expect_fingerprint is not None and fingerprint != expect_fingerprint:
            raise SidecarError("usage file belongs to another model (fingerprint differs)")
        if expect_dims is not None and (layers, experts) != tuple(expect_dims):
            raise SidecarError(f"usage file has dims {layers} x {experts}, the model has {expect_dims[0]} x {expect_dims[1]}")
        if not (0.0 < decay <= 1.0):
            raise SidecarError(f"usage file has an invalid decay {decay}")
        counts = np.frombuffer(data, dtype="<f4", count=layers * experts, offset=_HEADER.size)
        counts = counts.reshape(layers, experts).astype(np.float32)
        if not np.isfinite(counts).all() or (counts < 0).any():
            raise SidecarError("usage file holds negative or non-finite counts")
        return cls(fingerprint, counts, float(decay), int(turns))

    @classmethod
    def load(
        cls, path: Path, *, expect_fingerprint: str | None = None, expect_dims: tuple[int, int] | None = None
    ) -> UsageCounts:
        try:
            data = Path(path).read_bytes()
        except OSError as exc:
            raise SidecarError(f"cannot read usage file {path}: {exc.strerror}") from None
        return cls.from_bytes(data, expect_fingerprint=expect_fingerprint, expect_dims=expect_dims)

    def save(self, path: Path) -> None:
        """Replace `path` atomically with these counts."""
        path = Path(path)
        fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(self.to_bytes())
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise


def state_dir() -> Path:
    """Where Colibri keeps per-user state (sessions, usage of read-only containers): COLIBRI_STATE_DIR,
    else $XDG_STATE_HOME/colibri, else ~/.local/state/colibri."""
    env = os.environ.get("COLIBRI_STATE_DIR")
    if env:
        return Path(env)
    xdg = os.environ.get("XDG_STATE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".local" / "state") / "colibri"


def default_usage_path(container_path: Path, fingerprint: str) -> Path:
    """The container's own `.coli_usage` when its directory is writable, else one in the user's state directory."""
    container_path = Path(container_path)
    if os.access(container_path, os.W_OK):
        return container_path / USAGE_FILE_NAME
    return state_dir() / "usage" / f"{fingerprint[:32]}{USAGE_FILE_NAME}"
