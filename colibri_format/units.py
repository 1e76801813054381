"""Sizes in units people read, shared by every command line: 512 B, 3.0 KiB, 12.4 MiB, 1.50 GiB."""

from __future__ import annotations

_BINARY_UNITS = (("TiB", 1024**4), ("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024))


def human_bytes(n: float) -> str:
    """Bytes in binary units: one decimal below a GiB, two from a GiB up."""
    n = float(n)
    for unit, scale in _BINARY_UNITS:
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}" if unit in ("GiB", "TiB") else f"{n / scale:.1f} {unit}"
    return f"{int(n)} B"
