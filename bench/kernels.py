"""Kernel throughput against memory bandwidth, measured in the same run.

For each encoding and shape: GB/s of packed weights streamed (data + float16 scales) by the one-row (decode) kernel,
and GFLOP/s of the many-row (prefill) kernel. Memory bandwidth is a numpy copy of a large array, counted as bytes
read + bytes written per second (the STREAM "copy" convention). Every timing is the best of several repeats.

    python bench/kernels.py [--threads N] [--rows 32] [--json out.json]

Prints a table, then one JSON document (also written to --json if given).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time

import numba
import numpy as np
from colibri_runtime.kernels import linear, prepare_weight

from colibri_format.quant import quantize

# (label, out_features, in_features): OLMoE-1B-7B expert projections, its attention and a wide matrix.
SHAPES = (
    ("olmoe expert gate/up", 1024, 2048),
    ("olmoe expert down", 2048, 1024),
    ("olmoe attention q", 2048, 2048),
    ("wide 8192x4096", 8192, 4096),
)
ENCODINGS = ("int4_gs64", "int8_gs64")


def best_time(fn, repeats: int, inner: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        for _ in range(inner):
            fn()
        best = min(best, (time.perf_counter() - t) / inner)
    return best


def memory_bandwidth(nbytes: int = 512 * 1024**2, repeats: int = 5) -> float:
    a = np.ones(nbytes // 4, dtype=np.float32)
    b = np.empty_like(a)
    t = best_time(lambda: np.copyto(b, a), repeats, 1)
    return 2 * a.nbytes / t / 1e9


def run(rows: int, repeats: int) -> dict:
    rng = np.random.default_rng(0)
    results = []
    for label, out_f, in_f in SHAPES:
        w = rng.standard_normal((out_f, in_f)).astype(np.float32)
        for enc in ENCODINGS:
            pw = prepare_weight(quantize(w, enc))
            x1 = rng.standard_normal((1, in_f)).astype(np.float32)
            xn = rng.standard_normal((rows, in_f)).astype(np.float32)
            inner = max(1, int(2e8 // max(pw.nbytes, 1)))
            t1 = best_time(lambda x1=x1, pw=pw: linear(x1, pw), repeats, inner)
            tn = best_time(lambda xn=xn, pw=pw: linear(xn, pw), repeats, max(1, inner // 8))
            results.append({
                "shape": label, "out": out_f, "in": in_f, "encoding": enc, "packed_bytes": pw.nbytes,
                "one_row_us": t1 * 1e6, "one_row_gbps": pw.nbytes / t1 / 1e9,
                "many_rows": rows, "many_rows_gflops": 2 * rows * out_f * in_f / tn / 1e9,
            })
    return {"results": results}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=None, help="numba threads (default: all)")
    ap.add_argument("--rows", type=int, default=32, help="rows of the many-row (prefill) measurement")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", default=None, help="also write the JSON here")
    args = ap.parse_args()
    if args.threads:
        numba.set_num_threads(args.threads)
    bw = memory_bandwidth()
    out = run(args.rows, args.repeats)
    out.update({"memory_bandwidth_gbps": bw, "threads": numba.get_num_threads(), "cpu": platform.processor()
                or platform.machine(), "cores": os.cpu_count(), "load_average": os.getloadavg()})
    print(f"memory bandwidth (numpy copy, read+write): {bw:.1f} GB/s; numba threads {out['threads']}; "
          f"load average {out['load_average'][0]:.1f}")
    print(f"{'shape':<22} {'enc':<10} {'1 row us':>9} {'1 row GB/s':>11} {'x bw':>6} {f'{args.rows} rows GFLOP/s':>16}")
    for r in out["results"]:
        r["one_row_vs_bandwidth"] = r["one_row_gbps"] / bw
        print(f"{r['shape']:<22} {r['encoding']:<10} {r['one_row_us']:>9.1f} {r['one_row_gbps']:>11.2f} "
              f"{r['one_row_vs_bandwidth']:>6.2f} {r['many_rows_gflops']:>16.1f}")
    doc = json.dumps(out, indent=2)
    print(doc)
    if args.json:
        with open(args.json, "w") as f:
            f.write(doc + "\n")


if __name__ == "__main__":
    main()
