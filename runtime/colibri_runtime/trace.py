"""Routing traces (`colibri-run --trace FILE`): every (token, layer, expert) decision, plus lookahead predictions.

A trace is small and self-describing:

    magic  b"COLITRC1"
    u32    header length H, then H bytes of UTF-8 JSON:
           {"version": 1, "layers": [moe layer ids], "top_k": k, "num_experts": E, "tokens": T,
            "fingerprint": container fingerprint, "dtype": "int16"}
    u64    compressed length C1, then C1 bytes: zstd( int16[T, len(layers), k] routed expert ids )
    u64    compressed length C2, then C2 bytes: zstd( int16[T, len(layers), k] predicted ids, -1 where none )

Token rows follow the order in which the model processed positions (prefill rows, then one row per decoded token).
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from colibri_format.errors import SidecarError

TRACE_MAGIC = b"COLITRC1"
TRACE_VERSION = 1


@dataclass
class RoutingTrace:
    layers: list[int]
    top_k: int
    num_experts: int
    routed: np.ndarray  # int16 [T, L, k]
    predicted: np.ndarray  # int16 [T, L, k], -1 where no prediction was made
    fingerprint: str = ""

    @property
    def tokens(self) -> int:
        return int(self.routed.shape[0])

    def save(self, path: Path) -> None:
        import zstandard

        header = json.dumps(
            {
                "version": TRACE_VERSION,
                "layers": self.layers,
                "top_k": self.top_k,
                "num_experts": self.num_experts,
                "tokens": self.tokens,
                "fingerprint": self.fingerprint,
                "dtype": "int16",
            },
            sort_keys=True,
        ).encode()
        cctx = zstandard.ZstdCompressor(level=9)
        blobs = [cctx.compress(np.ascontiguousarray(a, dtype="<i2").tobytes()) for a in (self.routed, self.predicted)]
        path = Path(path)
        tmp = path.with_name(path.name + ".partial")
        with open(tmp, "wb") as f:
            f.write(TRACE_MAGIC + struct.pack("<I", len(header)) + header)
            for blob in blobs:
                f.write(struct.pack("<Q", len(blob)) + blob)
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: Path) -> RoutingTrace:
        import zstandard

        try:
            data = Path(path).read_bytes()
        except OSError as exc:
            raise SidecarError(f"cannot read routing trace {path}: {exc.strerror}") from None
        if data[:8] != TRACE_MAGIC:
            raise SidecarError(f"{path}: not a Colibri routing trace (bad magic)")
        try:
            (hlen,) = struct.unpack_from("<I", data, 8)
            header = json.loads(data[12 : 12 + hlen])
            pos = 12 + hlen
            arrays = []
            shape = (int(header["tokens"]), len(header["layers"]), int(header["top_k"]))
            dctx = zstandard.ZstdDecompressor()
            for _ in range(2):
                (clen,) = struct.unpack_from("<Q", data, pos)
                raw = dctx.decompress(data[pos + 8 : pos + 8 + clen], max_output_size=2 * int(np.prod(shape)))
                arrays.append(np.frombuffer(raw, dtype="<i2").reshape(shape).astype(np.int16))
                pos += 8 + clen
        except (struct.error, ValueError, KeyError, zstandard.ZstdError, json.JSONDecodeError) as exc:
            raise SidecarError(f"{path}: corrupt routing trace ({exc})") from None
        if header.get("version") != TRACE_VERSION:
            raise SidecarError(f"{path}: routing trace version {header.get('version')} is not supported")
        return cls(list(header["layers"]), int(header["top_k"]), int(header["num_experts"]), arrays[0], arrays[1],
                   str(header.get("fingerprint", "")))


class TraceRecorder:
    """Collects routing decisions and lookahead predictions as the model runs."""

    def __init__(self, layers: list[int], top_k: int, num_experts: int, fingerprint: str = "") -> None:
        self.layers = list(layers)
        self.top_k = top_k
        self.num_experts = num_experts
        self.fingerprint = fingerprint
        self._slot = {layer: i for i, layer in enumerate(self.layers)}
        self._routed: dict[int, list[np.ndarray]] = {layer: [] for layer in self.layers}
        self._predicted: dict[int, list[np.ndarray]] = {layer: [] for layer in self.layers}
        self._pending_prediction: dict[int, np.ndarray] = {}

    def predicted(self, layer: int, ids: np.ndarray) -> None:
        if layer in self._slot:
            self._pending_prediction[layer] = np.asarray(ids, dtype=np.int16).reshape(-1, self.top_k)

    def routed(self, layer: int, ids: np.ndarray) -> None:
        if layer not in self._slot:
            return
        ids = np.asarray(ids, dtype=np.int16).reshape(-1, self.top_k)
        self._routed[layer].append(ids)
        pred = self._pending_prediction.pop(layer, None)
        if pred is None or pred.shape != ids.shape:
            pred = np.full_like(ids, -1)
        self._predicted[layer].append(pred)

    def trace(self) -> RoutingTrace:
        tokens = min((sum(len(a) for a in v) for v in self._routed.values()), default=0)

        def stack(d: dict[int, list[np.ndarray]]) -> np.ndarray:
            cols = []
            for layer in self.layers:
                rows = np.concatenate(d[layer]) if d[layer] else np.zeros((0, self.top_k), np.int16)
                cols.append(rows[:tokens])
            return np.stack(cols, axis=1) if cols else np.zeros((tokens, 0, self.top_k), np.int16)

        return RoutingTrace(self.layers, self.top_k, self.num_experts, stack(self._routed), stack(self._predicted),
                            self.fingerprint)
