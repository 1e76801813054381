"""Expert routing heat: a layer x expert heatmap as a PNG (written with zlib and struct, no plotting library) and
the table of the hottest experts."""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

# Colour map stops (position, r, g, b): black -> purple -> orange -> pale yellow, readable in grey too.
_STOPS = np.array(
    [
        [0.00, 0, 0, 4],
        [0.25, 87, 16, 110],
        [0.50, 188, 55, 84],
        [0.75, 249, 142, 9],
        [1.00, 252, 255, 164],
    ],
    dtype=np.float64,
)
MAX_IMAGE_SIDE = 4096


def colormap(values: np.ndarray) -> np.ndarray:
    """RGB uint8 for values in [0, 1]."""
    v = np.clip(values, 0.0, 1.0)
    return np.stack([np.interp(v, _STOPS[:, 0], _STOPS[:, c]) for c in (1, 2, 3)], axis=-1).round().astype(np.uint8)


def png_bytes(rgb: np.ndarray) -> bytes:
    """Encode an (height, width, 3) uint8 image as a PNG."""
    rgb = np.ascontiguousarray(rgb, dtype=np.uint8)
    height, width, channels = rgb.shape
    if channels != 3:
        raise ValueError("png_bytes expects an RGB image")

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    raw = np.concatenate([np.zeros((height, 1), dtype=np.uint8), rgb.reshape(height, width * 3)], axis=1)
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)  # 8-bit RGB, no interlace
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(raw.tobytes(), 9)) + chunk(b"IEND", b"")


def heat_image(counts: np.ndarray, *, cell: int | None = None, log_scale: bool = True) -> np.ndarray:
    """One cell per (layer, expert), rows = layers, brightness = routing share within its layer."""
    counts = np.asarray(counts, dtype=np.float64)
    layers, experts = counts.shape
    totals = counts.sum(axis=1, keepdims=True)
    share = np.divide(counts, totals, out=np.zeros_like(counts), where=totals > 0)
    if log_scale:
        value = np.log1p(share * experts) / np.log1p(max(float((share * experts).max()), 1e-12))
    else:
        value = share / max(float(share.max()), 1e-12)
    if cell is None:
        cell = max(1, min(16, MAX_IMAGE_SIDE // max(experts, 1), MAX_IMAGE_SIDE // max(layers, 1)))
    img = colormap(value)
    return np.repeat(np.repeat(img, cell, axis=0), cell, axis=1)


def write_heatmap(path: Path, counts: np.ndarray, *, log_scale: bool = True) -> Path:
    path = Path(path)
    tmp = path.with_name(path.name + ".partial")
    tmp.write_bytes(png_bytes(heat_image(counts, log_scale=log_scale)))
    tmp.replace(path)
    return path


@dataclass(frozen=True)
class HotExpert:
    layer: int
    expert: int
    count: float
    layer_share: float  # share of its layer's routing mass
    total_share: float


def hottest(counts: np.ndarray, layers: tuple[int, ...], top: int) -> list[HotExpert]:
    counts = np.asarray(counts, dtype=np.float64)
    total = float(counts.sum()) or 1.0
    per_layer = counts.sum(axis=1)
    order = np.argsort(-counts, axis=None, kind="stable")[:top]
    out = []
    for flat in order:
        r, e = divmod(int(flat), counts.shape[1])
        c = float(counts[r, e])
        if c <= 0:
            break
        out.append(HotExpert(layers[r], e, c, c / per_layer[r] if per_layer[r] else 0.0, c / total))
    return out


def concentration(counts: np.ndarray, fractions=(0.05, 0.10, 0.25, 0.50)) -> dict[float, float]:
    """Share of the routing mass the hottest `f` of the experts carry, for each fraction f."""
    flat = np.sort(np.asarray(counts, dtype=np.float64).ravel())[::-1]
    total = float(flat.sum()) or 1.0
    cum = np.cumsum(flat)
    return {f: float(cum[max(0, round(f * flat.size) - 1)]) / total for f in fractions}
