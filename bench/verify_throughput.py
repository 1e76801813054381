"""Deep verification throughput against the raw read bandwidth of the same drive, both measured cold.

Builds (or reuses) a container of a few GB with random expert records, then:
1. drops every file of it from the page cache and reads them all with large sequential reads, no processing: the
   raw bandwidth;
2. drops them again and runs `verify --deep` (sha256 of every file, crc32 of every record, finite scales).
Prints a table and writes bench/out/verify_throughput.json. The goal is verify >= 0.8 x raw.

    python bench/verify_throughput.py [--dir /tmp/colibri-bench-verify] [--gb 3] [--jobs N] [--rebuild]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import shutil
import statistics
import sys
import time
import zlib
from pathlib import Path

import numpy as np
from colibri_inspect.scan import default_jobs, drop_page_cache, measure_read_bandwidth
from colibri_inspect.verify import verify_container

from colibri_format.errors import ColibriError
from colibri_format.quant import QuantizedTensor, quantize
from colibri_format.reader import Container
from colibri_format.writer import ContainerWriter

HIDDEN, INTER, EXPERTS = 2048, 1024, 128


def random_int4(rng: np.random.Generator, shape: tuple[int, int]) -> QuantizedTensor:
    rows, cols = shape
    data = np.frombuffer(rng.bytes(rows * cols // 2), dtype=np.uint8).reshape(rows, cols // 2)
    scales = (rng.standard_normal((rows, cols // 64)) * 1e-3).astype(np.float16)
    return QuantizedTensor("int4_gs64", shape, data, scales)


def build(path: Path, gb: float) -> None:
    rng = np.random.default_rng(0)
    probe = random_int4(rng, (INTER, HIDDEN))
    per_expert = 3 * probe.nbytes
    layers = max(1, round(gb * 1e9 / per_expert / EXPERTS))
    config = {
        "model_type": "qwen3_moe", "num_hidden_layers": layers, "hidden_size": HIDDEN, "vocab_size": 4096,
        "num_attention_heads": 16, "num_key_value_heads": 4, "head_dim": 128, "moe_intermediate_size": INTER,
        "num_experts": EXPERTS, "num_experts_per_tok": 8, "decoder_sparse_step": 1, "mlp_only_layers": [],
    }
    w = ContainerWriter(path, family="qwen3_moe", config=config, source={"repo": "bench/random"}, shard_bytes=1024**3)
    w.add_tensor("model.embed_tokens.weight", quantize(rng.standard_normal((4096, HIDDEN)).astype(np.float32), "int8_gs64"))
    for layer in range(layers):
        for e in range(EXPERTS):
            w.add_expert(layer, e, gate=random_int4(rng, (INTER, HIDDEN)), up=random_int4(rng, (INTER, HIDDEN)),
                         down=random_int4(rng, (HIDDEN, INTER)))
    w.finish()


def cpu_reference(nbytes: int = 256 * 1024**2) -> list[dict]:
    """In-memory sha256 and crc32 rates on one thread: the CPU ceiling of deep verification per hashing thread."""
    data = np.random.default_rng(1).bytes(nbytes)
    out = []
    for name, fn in (("sha256 in memory, 1 thread", lambda: hashlib.sha256(data).digest()),
                     ("crc32 in memory, 1 thread", lambda: zlib.crc32(data))):
        t = time.perf_counter()
        fn()
        seconds = time.perf_counter() - t
        out.append({"what": name, "bytes": nbytes, "seconds": seconds, "gbps": nbytes / seconds / 1e9, "cold": False})
    return out


def container_files(path: Path) -> list[Path]:
    return sorted(p for p in path.iterdir() if p.is_file() and not p.name.startswith("."))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", type=Path, default=Path("/tmp/colibri-bench-verify"))
    ap.add_argument("--gb", type=float, default=3.0)
    ap.add_argument("--jobs", type=int, default=None)
    ap.add_argument("--rebuild", action="store_true")
    ap.add_argument("--repeat", type=int, default=3, help="rounds of raw read + verify, alternating")
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "out" / "verify_throughput.json")
    args = ap.parse_args()
    jobs = args.jobs or default_jobs()

    if args.rebuild and args.dir.exists():
        shutil.rmtree(args.dir)
    built = False
    try:
        Container.open(args.dir).close()
    except ColibriError:
        shutil.rmtree(args.dir, ignore_errors=True)
        t = time.perf_counter()
        build(args.dir, args.gb)
        built = True
        print(f"built {args.dir} in {time.perf_counter() - t:.1f} s", file=sys.stderr)
    files = container_files(args.dir)
    total = sum(p.stat().st_size for p in files)

    # Raw reads and deep verification alternate, `--repeat` rounds, so a shared drive's drift hits both alike;
    # the ratio is taken round by round and its median reported.
    rows, ratios, crc_ratios = [], [], []
    report = None
    for round_ in range(args.repeat):
        raw = measure_read_bandwidth(files, jobs=jobs)
        rows.append({"what": f"raw read, {jobs} stream(s), round {round_ + 1}", "bytes": raw.nbytes,
                     "seconds": raw.seconds, "gbps": raw.gbps, "cold": raw.cold})
        for crc_only in (False, True):
            for p in files:
                drop_page_cache(p)
            t = time.perf_counter()
            report = verify_container(args.dir, deep=True, jobs=jobs, crc_only=crc_only)
            seconds = time.perf_counter() - t
            if not report.ok:
                raise SystemExit(f"benchmark container does not verify: {report.findings[:3]}")
            gbps = report.bytes_read / seconds / 1e9
            mode = "verify --deep --crc-only" if crc_only else "verify --deep"
            rows.append({"what": f"{mode}, {jobs} job(s), round {round_ + 1}", "bytes": report.bytes_read,
                         "seconds": seconds, "gbps": gbps, "cold": True})
            (crc_ratios if crc_only else ratios).append(gbps / raw.gbps)
    raw_best = statistics.median(r["gbps"] for r in rows if r["what"].startswith("raw"))
    verify_gbps = statistics.median(r["gbps"] for r in rows if r["what"].startswith("verify --deep,"))
    crc_gbps = statistics.median(r["gbps"] for r in rows if r["what"].startswith("verify --deep --crc-only"))
    rows.extend(cpu_reference())
    print(f"container {args.dir}: {total / 1e9:.2f} GB in {len(files)} files, {report.records_checked} records")
    print(f"{'measurement':40} {'GB':>7} {'s':>8} {'GB/s':>7} {'x raw':>6}")
    for r in rows:
        print(f"{r['what']:40} {r['bytes'] / 1e9:7.2f} {r['seconds']:8.2f} {r['gbps']:7.2f} {r['gbps'] / raw_best:6.2f}")
    result = {
        "container_bytes": total,
        "files": len(files),
        "records": report.records_checked,
        "jobs": jobs,
        "cpus": os.cpu_count(),
        "machine": platform.platform(),
        "built_now": built,
        "load_average": os.getloadavg(),
        "raw_gbps": raw_best,
        "verify_deep_gbps": verify_gbps,
        "ratio": statistics.median(ratios),
        "ratios": ratios,
        "verify_deep_crc_only_gbps": crc_gbps,
        "crc_only_ratio": statistics.median(crc_ratios),
        "rows": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"median raw {raw_best:.2f} GB/s; verify --deep {verify_gbps:.2f} GB/s (ratio {result['ratio']:.2f}); "
          f"--crc-only {crc_gbps:.2f} GB/s (ratio {result['crc_only_ratio']:.2f}); goal >= 0.8; wrote {args.out}")


if __name__ == "__main__":
    main()
