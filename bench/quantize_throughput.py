"""Quantizer throughput: the numba quantizer against the numpy reference, in GB/s of float32 input.

    python bench/quantize_throughput.py [--rows 2048 --cols 7168] [--repeats 3]

Prints a table and writes bench/out/quantize_throughput.json. Median of --repeats runs after one warm-up.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import time
from pathlib import Path

import numpy as np

from colibri_format.quant import quantize, quantize_reference


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    except OSError:
        return "unknown"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=2048)
    ap.add_argument("--cols", type=int, default=7168)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", type=Path, default=Path("bench/out/quantize_throughput.json"))
    args = ap.parse_args()
    x = np.random.default_rng(0).standard_normal((args.rows, args.cols)).astype(np.float32)
    results = {"machine": {"cpus": os.cpu_count(), "platform": platform.platform()}, "commit": _commit(),
               "shape": [args.rows, args.cols], "input_bytes": x.nbytes, "runs": {}}
    print(f"{'quantizer':<12}{'encoding':<12}{'GB/s (f32 in)':>15}{'x reference':>13}")
    for encoding in ("int4_gs64", "int8_gs64"):
        speeds = {}
        for name, fn in (("reference", quantize_reference), ("fast", quantize)):
            fn(x[:64], encoding)  # warm-up (compiles the numba kernel)
            times = []
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                fn(x, encoding)
                times.append(time.perf_counter() - t0)
            speeds[name] = x.nbytes / statistics.median(times) / 1e9
        for name, gbps in speeds.items():
            print(f"{name:<12}{encoding:<12}{gbps:>15.2f}{gbps / speeds['reference']:>13.2f}")
        results["runs"][encoding] = speeds
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(results, indent=2))
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
