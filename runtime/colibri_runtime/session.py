"""Persistent attention state (`.coli_kv`): a chat reopened later continues with no re-prefill.

The file holds, for every token the model has consumed, the token id and the state each layer keeps for it (MLA:
normalized latent then roped shared key, then the DSA indexer key on layers with an indexer; GQA: the K then the V
of every KV head). It is bound to one model (the container fingerprint) and to the numerics the state was computed
under (a tag such as "dsa=sparse"). Records are only ever appended; the committed count is written last.

File layout (all integers little-endian)
----------------------------------------
Header, HEADER_SIZE = 4096 bytes:

    offset      size  field
    0           8     magic b"COLIKV01"
    8           4     u32 version = 1
    12          4     u32 header_size = 4096 (records start here)
    16          4     u32 dtype of the state floats: 1 = float32 little-endian (the only one defined)
    20          4     u32 L = number of layers (1 <= L <= 991)
    24          4     u32 record_size = 12 + 4 * W, where W = sum of the per-layer widths
    28          4     u32 reserved, 0
    32          32    model fingerprint: the 32 bytes whose hex is the container manifest's "fingerprint"
    64          32    state tag: sha256 of the UTF-8 tag string naming the runtime numerics the state depends on
    96          4*L   u32 floats per token of layer 0 .. L-1 (each >= 1)
    96+4L       4     u32 crc32 of bytes [0, 96+4L)
    ...               zero
    4064        8     u64 committed record count N
    4072        4     u32 crc32 of bytes [4064, 4072)
    4076        20    zero

Record i (0 <= i < N) at offset 4096 + i * record_size:

    0           4     u32 token id
    4           4     u32 flags: bit 0 = this token opened a forward step (it and the records up to the next one
                      with bit 0 set were fed to the model in one call); other bits 0
    8           4*W   float32 state: layer 0's floats, then layer 1's, ... (widths from the header)
    8+4W        4     u32 crc32 of bytes [0, 8+4W) of the record

Writing: a step's records go to 4096 + N * record_size (over whatever uncommitted bytes a crash left there), then
fsync, then the commit block (N' and its crc32) is rewritten in place, then fsync. The commit block lies inside one
512-byte sector, so it is written whole or not at all: after a crash the file reads as its last commit. Bytes beyond
record N are not part of the file's content; readers ignore them, writers overwrite or truncate them.

Reading: magic, version, header size, dtype, dims and both crcs are checked, the file must hold N whole records and
every record's crc must match. A file that fails any check, or that belongs to another model, other layer widths or
another state tag, is not used: `open_session` warns (SessionWarning) and starts a fresh file, keeping the old one
as `NAME.coli_kv.stale`.

Resuming: the records of the longest common prefix of the stored tokens and the new prompt are reused (a record's
state depends only on the tokens up to it) and the rest of the prompt is fed. If the prompt is exactly the stored
tokens (continuing an interrupted answer), the records from the start of the last forward step on are dropped and
that step is fed again: the same call on the same state, so the continuation is bit-identical to a session that was
never interrupted. A prompt that shares no leading token with the stored ones starts fresh, with a warning.

Sessions live in the user's state directory (`state_dir()/sessions`: $COLIBRI_STATE_DIR, else
$XDG_STATE_HOME/colibri, else ~/.local/state/colibri), never inside the container, which may be read-only.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import os
import re
import struct
import warnings
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from colibri_format.constants import KV_FILE_SUFFIX, KV_MAGIC, KV_VERSION
from colibri_format.errors import SidecarError
from colibri_format.usage import state_dir

HEADER_SIZE = 4096
DTYPE_FLOAT32 = 1
MAX_LAYERS = 991
COMMIT_OFFSET = 4064
FLAG_STEP_START = 1

_FIXED = struct.Struct("<8sIIIIII32s32s")  # magic .. state tag: 96 bytes
_COMMIT = struct.Struct("<Q")
_U32 = struct.Struct("<I")
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


class SessionWarning(UserWarning):
    """A stored session could not be used; the session starts fresh."""


def sessions_dir() -> Path:
    return state_dir() / "sessions"


def session_path(name: str) -> Path:
    """The file of session NAME (letters, digits, '.', '_', '-'; no path separators)."""
    if not _NAME_RE.match(name) or name in (".", ".."):
        raise SidecarError(
            f"invalid session name {name!r}: use 1-128 letters, digits, '.', '_' or '-', starting with a letter or digit"
        )
    return sessions_dir() / f"{name}{KV_FILE_SUFFIX}"


def state_tag_digest(tag: str) -> bytes:
    return hashlib.sha256(tag.encode("utf-8")).digest()


@dataclass(frozen=True)
class SessionLayout:
    """What a session file is bound to: the model, the numerics tag and each layer's floats per token."""

    fingerprint: str
    layer_widths: tuple[int, ...]
    tag: str = ""

    @property
    def width(self) -> int:
        return sum(self.layer_widths)

    @property
    def record_size(self) -> int:
        return 12 + 4 * self.width

    def offsets(self) -> list[int]:
        return [int(x) for x in np.cumsum((0,) + self.layer_widths)]

    def header_bytes(self) -> bytes:
        fp = bytes.fromhex(self.fingerprint)
        if len(fp) != 32:
            raise SidecarError(f"model fingerprint must be 32 bytes (64 hex digits), got {len(fp)} bytes")
        if not 1 <= len(self.layer_widths) <= MAX_LAYERS or min(self.layer_widths) < 1:
            raise SidecarError(f"session needs 1..{MAX_LAYERS} layers of at least one float each")
        fixed = _FIXED.pack(
            KV_MAGIC,
            KV_VERSION,
            HEADER_SIZE,
            DTYPE_FLOAT32,
            len(self.layer_widths),
            self.record_size,
            0,
            fp,
            state_tag_digest(self.tag),
        )
        body = fixed + struct.pack(f"<{len(self.layer_widths)}I", *self.layer_widths)
        head = body + _U32.pack(zlib.crc32(body))
        return head + bytes(HEADER_SIZE - len(head))


def _commit_block(count: int) -> bytes:
    packed = _COMMIT.pack(count)
    return packed + _U32.pack(zlib.crc32(packed))


def _record_dtype(width: int) -> np.dtype:
    return np.dtype([("token", "<u4"), ("flags", "<u4"), ("state", "<f4", (width,)), ("crc", "<u4")])


@dataclass(frozen=True)
class StoredSession:
    tokens: np.ndarray  # uint32 [N]
    flags: np.ndarray  # uint32 [N]
    states: np.ndarray  # float32 [N, W]


def read_session_file(path: Path, layout: SessionLayout) -> StoredSession:
    """Validate and read a session file written for `layout`; SidecarError says why it cannot be used."""
    with open(path, "rb") as f:
        header = f.read(HEADER_SIZE)
        if len(header) < HEADER_SIZE:
            raise SidecarError(f"{path}: truncated header ({len(header)} of {HEADER_SIZE} bytes)")
        magic, version, header_size, dtype, layers, record_size, _, fp, tag = _FIXED.unpack_from(header)
        if magic != KV_MAGIC:
            raise SidecarError(f"{path}: not a session file (magic {magic!r})")
        if version != KV_VERSION:
            raise SidecarError(f"{path}: session format version {version}, this runtime reads {KV_VERSION}")
        if header_size != HEADER_SIZE or dtype != DTYPE_FLOAT32 or not 1 <= layers <= MAX_LAYERS:
            raise SidecarError(f"{path}: malformed header")
        end = _FIXED.size + 4 * layers
        (crc,) = _U32.unpack_from(header, end)
        if crc != zlib.crc32(header[:end]):
            raise SidecarError(f"{path}: header checksum mismatch")
        if fp != bytes.fromhex(layout.fingerprint):
            raise SidecarError(f"{path}: belongs to another model (fingerprint {fp.hex()[:16]}...)")
        if tag != state_tag_digest(layout.tag):
            raise SidecarError(f"{path}: state was computed under other runtime settings")
        widths = struct.unpack_from(f"<{layers}I", header, _FIXED.size)
        if tuple(widths) != tuple(layout.layer_widths) or record_size != layout.record_size:
            raise SidecarError(f"{path}: layer dims {widths} differ from the model's {layout.layer_widths}")
        (count,) = _COMMIT.unpack_from(header, COMMIT_OFFSET)
        (commit_crc,) = _U32.unpack_from(header, COMMIT_OFFSET + 8)
        if commit_crc != zlib.crc32(header[COMMIT_OFFSET : COMMIT_OFFSET + 8]):
            raise SidecarError(f"{path}: commit block checksum mismatch")
        size = os.fstat(f.fileno()).st_size
        if HEADER_SIZE + count * record_size > size:
            raise SidecarError(f"{path}: truncated: {count} records committed, file holds fewer")
        raw = f.read(count * record_size)
    records = np.frombuffer(raw, dtype=_record_dtype(layout.width), count=count)
    body = record_size - 4
    for i in range(count):
        start = i * record_size
        if zlib.crc32(raw[start : start + body]) != int(records["crc"][i]):
            raise SidecarError(f"{path}: record {i} is corrupt (checksum mismatch)")
    return StoredSession(records["token"].copy(), records["flags"].copy(), records["state"].copy())


class SessionFile:
    """An open, locked session file: append steps, drop uncommitted or superseded records."""

    def __init__(self, path: Path, layout: SessionLayout, fd: int, count: int) -> None:
        self.path = path
        self.layout = layout
        self._fd = fd
        self._count = count
        self._dtype = _record_dtype(layout.width)

    @property
    def num_records(self) -> int:
        return self._count

    @classmethod
    def create(cls, path: Path, layout: SessionLayout) -> SessionFile:
        """A new empty session at `path` (replacing any file there atomically)."""
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        with open(tmp, "wb") as f:
            header = bytearray(layout.header_bytes())
            header[COMMIT_OFFSET : COMMIT_OFFSET + 12] = _commit_block(0)
            f.write(header)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        _fsync_dir(path.parent)
        return cls._locked(path, layout, 0)

    @classmethod
    def _locked(cls, path: Path, layout: SessionLayout, count: int) -> SessionFile:
        fd = os.open(path, os.O_RDWR)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(fd)
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise SidecarError(f"session {path} is in use by another process") from None
            raise
        return cls(path, layout, fd, count)

    def append(self, token_ids, states: np.ndarray) -> None:
        """Commit one forward step: token_ids [n] and their states [n, W] (layers concatenated)."""
        tokens = np.asarray(token_ids, dtype=np.uint32).reshape(-1)
        states = np.asarray(states, dtype=np.float32)
        n = tokens.shape[0]
        if n == 0:
            return
        if states.shape != (n, self.layout.width):
            raise SidecarError(
                f"session step states of shape {states.shape}, expected {(n, self.layout.width)}"
            )
        records = np.zeros(n, dtype=self._dtype)
        records["token"] = tokens
        records["flags"][0] = FLAG_STEP_START
        records["state"] = states
        raw = bytearray(records.tobytes())
        size, body = self.layout.record_size, self.layout.record_size - 4
        for i in range(n):
            start = i * size
            raw[start + body : start + size] = _U32.pack(zlib.crc32(raw[start : start + body]))
        offset = HEADER_SIZE + self._count * size
        _pwrite_all(self._fd, bytes(raw), offset)
        os.fsync(self._fd)
        self._commit(self._count + n)

    def truncate(self, count: int) -> None:
        """Keep only the first `count` records (committed first, then the bytes are cut)."""
        if not 0 <= count <= self._count:
            raise SidecarError(f"cannot keep {count} of {self._count} records")
        self._commit(count)
        os.ftruncate(self._fd, HEADER_SIZE + count * self.layout.record_size)

    def _commit(self, count: int) -> None:
        _pwrite_all(self._fd, _commit_block(count), COMMIT_OFFSET)
        os.fsync(self._fd)
        self._count = count

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def _pwrite_all(fd: int, data: bytes, offset: int) -> None:
    view = memoryview(data)
    while view:
        written = os.pwrite(fd, view, offset)
        view = view[written:]
        offset += written


def _fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@dataclass
class OpenedSession:
    """A session ready to continue `prompt`: the first `reuse` tokens' states are restored, `feed` remain to be fed.

    `status` is "new" (no file), "resumed" (records reused) or "fresh" (a file existed but could not be used;
    `reason` says why and a SessionWarning was issued). `tokens` are the reused tokens' ids."""

    file: SessionFile
    status: str
    reuse: int
    states: np.ndarray  # float32 [reuse, W]
    feed: list[int]
    reason: str = ""
    tokens: list[int] = field(default_factory=list)  # the reused tokens

    def layer_states(self, layer: int) -> np.ndarray:
        offs = self.file.layout.offsets()
        return self.states[:, offs[layer] : offs[layer + 1]]


def resume_point(stored_tokens: np.ndarray, flags: np.ndarray, prompt: list[int]) -> int | None:
    """How many stored records a new prompt can reuse, or None when it shares no leading token with them.

    Each record's state depends only on the tokens up to it, so the records of the longest common prefix stay valid
    whatever follows (a chat whose template re-renders the last answer differently reuses everything before it).
    At least one prompt token is always left to feed, since its logits are needed; a prompt equal to the stored
    tokens re-feeds their whole last forward step."""
    n = len(stored_tokens)
    common = 0
    for a, b in zip(stored_tokens, prompt, strict=False):
        if int(a) != int(b):
            break
        common += 1
    if common == 0:
        return None if n else 0
    if common == n and len(prompt) > n:
        return n
    if common == n == len(prompt):
        starts = np.flatnonzero(flags & FLAG_STEP_START)
        return int(starts[-1]) if len(starts) else 0
    return min(common, len(prompt) - 1)


def open_session(
    path: str | Path, layout: SessionLayout, prompt: list[int], *, continue_stored: bool = False
) -> OpenedSession:
    """Open (or create) the session at `path` for `prompt`; never fails on a bad file, warns and starts fresh.

    continue_stored=True continues an answer that was interrupted: when the stored tokens extend `prompt`, the prompt
    becomes the stored tokens (and the last step is fed again to produce the next token)."""
    path = Path(path)
    prompt = [int(t) for t in prompt]
    empty = np.zeros((0, layout.width), np.float32)
    if not path.exists():
        return OpenedSession(SessionFile.create(path, layout), "new", 0, empty, prompt)
    file = SessionFile._locked(path, layout, 0)  # refuses a session another process has open
    reason = ""
    try:
        stored = read_session_file(path, layout)
        known = [int(t) for t in stored.tokens]
        if continue_stored and known[: len(prompt)] == prompt:
            prompt = known
        reuse = resume_point(stored.tokens, stored.flags, prompt)
        if reuse is None:
            reason = f"{path}: the prompt does not continue the stored conversation"
    except SidecarError as exc:
        reason = str(exc)
    if reason:
        file.close()
        warnings.warn(f"session not resumed, starting fresh: {reason}", SessionWarning, stacklevel=2)
        os.replace(path, path.with_name(path.name + ".stale"))
        return OpenedSession(SessionFile.create(path, layout), "fresh", 0, empty, prompt, reason)
    file._count = len(stored.tokens)
    file.truncate(reuse)
    return OpenedSession(file, "resumed", reuse, stored.states[:reuse], prompt[reuse:], tokens=known[:reuse])


# --- binding a model's per-sequence state to a session file -------------------------------------------------------


def cache_width(cache) -> int:
    """Floats per token of one layer's cache: MLA caches say so; GQA KV caches hold K then V of every KV head."""
    width = getattr(cache, "state_width", None)
    if width is not None:
        return int(width)
    return int(cache.n_kv_heads * (cache.k_dim + cache.v_dim))


def export_cache_rows(cache, start: int, stop: int) -> np.ndarray:
    if hasattr(cache, "export_rows"):
        return cache.export_rows(start, stop)
    n = stop - start
    return np.concatenate([cache.k[start:stop].reshape(n, -1), cache.v[start:stop].reshape(n, -1)], axis=1)


def import_cache_rows(cache, rows: np.ndarray) -> None:
    if hasattr(cache, "import_rows"):
        cache.import_rows(rows)
        return
    n = rows.shape[0]
    k_width = cache.n_kv_heads * cache.k_dim
    cache.append(
        rows[:, :k_width].reshape(n, cache.n_kv_heads, cache.k_dim),
        rows[:, k_width:].reshape(n, cache.n_kv_heads, cache.v_dim),
    )


class ModelSession:
    """A model's sequence state persisted in a `.coli_kv` file.

    session = ModelSession(model, path, container.fingerprint)
    state, feed = session.open(prompt_ids)      # restored state, tokens still to feed
    start = state.length
    logits = model.forward([feed], [state])[0]
    session.commit(state, start)                 # after every forward step
    """

    def __init__(self, model, path: str | Path, fingerprint: str, tag: str | None = None) -> None:
        self.model = model
        self.path = Path(path)
        probe = model.new_state()
        widths = tuple(cache_width(c) for c in probe.caches)
        self.layout = SessionLayout(
            fingerprint, widths, tag if tag is not None else getattr(model, "state_tag", "")
        )
        self.file: SessionFile | None = None
        self.opened: OpenedSession | None = None

    def open(self, prompt, *, continue_stored: bool = False):
        """(SequenceState restored from the file, token ids still to feed). status/reason on self.opened."""
        self.close()
        opened = open_session(
            self.path, self.layout, [int(t) for t in prompt], continue_stored=continue_stored
        )
        self.opened, self.file = opened, opened.file
        state = self.model.new_state()
        offsets = self.layout.offsets()
        for i, cache in enumerate(state.caches):
            import_cache_rows(cache, opened.states[:, offsets[i] : offsets[i + 1]])
        state.tokens.extend(opened.tokens)
        return state, opened.feed

    def commit(self, state, start: int) -> None:
        """Persist the tokens state.tokens[start:] (one forward step) and their states."""
        stop = state.length
        if stop <= start:
            return
        rows = np.concatenate([export_cache_rows(c, start, stop) for c in state.caches], axis=1)
        self.file.append(state.tokens[start:stop], rows)

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
            self.file = None
