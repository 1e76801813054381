"""Kernel throughput against memory bandwidth, measured in the same run.

For each encoding (int4_gs64, int8_gs64), shape and thread count (1 and 2 by default):
- one row (decode), streamed: GB/s of packed weights (codes + float16 scales, as stored in a container) when the
  kernel walks a different matrix every call, from a pool of `--pool-mb` MiB of random packed weights, so the weights
  come from DRAM, not from a cache. This is the figure that bounds decode speed.
- one row, hot: the same matrix again and again (cache-resident): the kernel's compute limit.
- many rows (prefill): GFLOP/s at `--rows` rows.
Memory bandwidth is a read-only reduction over a 1 GiB array at the same thread count (integer sum of 64-bit words
split across the numba threads; numpy's single-threaded float sum is also reported). Kernel and bandwidth figures
are medians of `--repeats` timings, after a warm-up call.

    python bench/kernels.py [--threads 1 2] [--rows 32] [--repeats 5] [--pool-mb 512] [--json bench/out/kernels.json]

Prints a table, then writes the JSON document (raw figures, machine, commit, load average) to --json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import time
from pathlib import Path

import numba
import numpy as np
from colibri_runtime.kernels import (
    KIND_INT4,
    KIND_INT8,
    PreparedWeight,
    linear,
    warm_up,
)

from colibri_format.constants import GROUP_SIZE

# (label, out_features, in_features): OLMoE-1B-7B expert projections, its attention and a wide matrix.
SHAPES = (
    ("olmoe expert gate/up", 1024, 2048),
    ("olmoe expert down", 2048, 1024),
    ("olmoe attention q", 2048, 2048),
    ("wide 8192x4096", 8192, 4096),
)
ENCODINGS = {"int4_gs64": (KIND_INT4, GROUP_SIZE // 2), "int8_gs64": (KIND_INT8, GROUP_SIZE)}
ROOT = Path(__file__).resolve().parents[1]


def median_time(fn, repeats: int, inner: int = 1) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        for _ in range(inner):
            fn()
        times.append((time.perf_counter() - t) / inner)
    return float(np.median(times))


@numba.njit(parallel=True, nogil=True, cache=True)
def _read_sum(words, chunks):  # pragma: no cover - compiled
    n = words.shape[0]
    step = -(-n // chunks)
    partial = np.zeros(chunks, np.uint64)
    for c in numba.prange(chunks):
        s = np.uint64(0)
        for k in range(c * step, min(n, (c + 1) * step)):
            s += words[k]
        partial[c] = s
    return partial.sum()


def memory_bandwidth(repeats: int, nbytes: int = 1024**3) -> dict:
    """Read-only bandwidth in GB/s: numba threads summing 64-bit words, and numpy's float32 sum (one thread)."""
    a = np.ones(nbytes // 4, dtype=np.float32)
    words = a.view(np.uint64)
    chunks = 64 * numba.get_num_threads()
    t_threads = median_time(lambda: _read_sum(words, chunks), repeats)
    t_numpy = median_time(lambda: a.sum(), repeats)
    return {"read_gbps": nbytes / t_threads / 1e9, "numpy_sum_gbps": nbytes / t_numpy / 1e9}


def weight_pool(kind: int, out_f: int, in_f: int, pool_bytes: int, rng) -> list[PreparedWeight]:
    """Distinct random packed weights of one shape, about pool_bytes in all (views of one buffer)."""
    groups = -(-in_f // GROUP_SIZE)
    row_bytes = groups * ENCODINGS["int4_gs64" if kind == KIND_INT4 else "int8_gs64"][1]
    count = max(2, pool_bytes // (out_f * row_bytes))
    data = rng.integers(0, 256, size=(count, out_f, row_bytes), dtype=np.uint8)
    if kind == KIND_INT8:
        data = data.view(np.int8)
    scales = (rng.random((count, out_f, groups), dtype=np.float32) * 0.01).astype(np.float16).astype(np.float32)
    return [PreparedWeight(kind, data[k], scales[k], out_f, in_f, groups) for k in range(count)]


def measure(rows: int, repeats: int, pool_bytes: int, rng) -> list[dict]:
    results = []
    for label, out_f, in_f in SHAPES:
        x1 = rng.standard_normal((1, in_f)).astype(np.float32)
        xn = rng.standard_normal((rows, in_f)).astype(np.float32)
        for enc, (kind, _) in ENCODINGS.items():
            pool = weight_pool(kind, out_f, in_f, pool_bytes, rng)
            packed = pool[0].nbytes  # codes + float16 scales, as stored

            def stream(pool=pool, x1=x1):
                for pw in pool:
                    linear(x1, pw)

            t_stream = median_time(stream, repeats) / len(pool)
            inner = max(1, int(5e7 // packed))
            t_hot = median_time(lambda pw=pool[0], x1=x1: linear(x1, pw), repeats, inner)
            t_many = median_time(lambda pw=pool[0], xn=xn: linear(xn, pw), repeats, max(1, inner // 16))
            results.append({
                "shape": label, "out": out_f, "in": in_f, "encoding": enc, "packed_bytes": packed,
                "pool_matrices": len(pool),
                "one_row_stream_us": t_stream * 1e6, "one_row_stream_gbps": packed / t_stream / 1e9,
                "one_row_hot_us": t_hot * 1e6, "one_row_hot_gbps": packed / t_hot / 1e9,
                "many_rows": rows, "many_rows_gflops": 2 * rows * out_f * in_f / t_many / 1e9,
            })
            del pool
    return results


def commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2], help="numba thread counts to measure")
    ap.add_argument("--rows", type=int, default=32, help="rows of the many-row (prefill) measurement")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--pool-mb", type=int, default=512, help="MiB of distinct weights cycled by the stream test")
    ap.add_argument("--json", default=str(ROOT / "bench" / "out" / "kernels.json"))
    args = ap.parse_args()
    warm_up()
    rng = np.random.default_rng(0)
    runs = []
    for threads in args.threads:
        numba.set_num_threads(threads)
        bw = memory_bandwidth(args.repeats)
        results = measure(args.rows, args.repeats, args.pool_mb * 1024**2, rng)
        for r in results:
            r["stream_vs_bandwidth"] = r["one_row_stream_gbps"] / bw["read_gbps"]
        runs.append({"threads": threads, "memory": bw, "results": results})
    doc = {"machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                       "numba": numba.__version__}, "commit": commit(),
           "command": "python bench/kernels.py " + " ".join(f"--threads {' '.join(map(str, args.threads))} "
                                                            f"--rows {args.rows} --repeats {args.repeats} "
                                                            f"--pool-mb {args.pool_mb}".split()),
           "load_average": os.getloadavg(), "runs": runs}
    for run in runs:
        bw = run["memory"]
        print(f"\nthreads {run['threads']}: memory read bandwidth {bw['read_gbps']:.1f} GB/s "
              f"(numpy float sum, 1 thread: {bw['numpy_sum_gbps']:.1f} GB/s)")
        print(f"{'shape':<22} {'enc':<10} {'stream us':>9} {'stream GB/s':>11} {'x bw':>5} {'hot GB/s':>9} "
              f"{f'{args.rows} rows GFLOP/s':>16}")
        for r in run["results"]:
            print(f"{r['shape']:<22} {r['encoding']:<10} {r['one_row_stream_us']:>9.1f} "
                  f"{r['one_row_stream_gbps']:>11.2f} {r['stream_vs_bandwidth']:>5.2f} {r['one_row_hot_gbps']:>9.2f} "
                  f"{r['many_rows_gflops']:>16.1f}")
    print(f"\nload average {doc['load_average'][0]:.1f}; commit {doc['commit']}")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(doc, indent=2) + "\n")
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
