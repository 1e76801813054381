"""Conversion throughput against the raw read bandwidth of the same disk, and the converter's peak memory.

For each round: drop the source shards from the page cache (fsync, then posix_fadvise DONTNEED), read them front to
back with large sequential reads, once through the page cache and once with O_DIRECT (the raw bound is the faster of
the two), drop them again, then run the converter on them in a child process (cold source, fresh output folder) and
take its wall time, CPU time and peak RSS (wait4's ru_maxrss). Rounds alternate raw reads and conversions so drift from
other work on the machine hits both alike. Reports medians, and the CPU seconds the conversion spends per GB of source
(on a busy machine the CPU, not the disk, may be what bounds it).

    python bench/convert_throughput.py [--source /work/benchdata/olmoe-random-8l] [--repeats 3] [--workers N]

Writes bench/out/convert_throughput.json. Make the source with bench/make_random_checkpoint.py.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
OUT_JSON = ROOT / "bench" / "out" / "convert_throughput.json"
READ_CHUNK = 64 * 1024 * 1024

CHILD = """
import json, sys, time
from pathlib import Path
from colibri_convert.convert import convert
from colibri_convert.sources import LocalSource
t = time.perf_counter()
kwargs = {"workers": int(sys.argv[3])} if int(sys.argv[3]) else {}
s = convert(LocalSource(Path(sys.argv[1])), Path(sys.argv[2]), **kwargs)
print(json.dumps({"seconds": s.seconds, "source_bytes": s.source_bytes_read, "container_bytes": s.container_bytes,
                  "wall_in_process": time.perf_counter() - t}))
"""


def shard_paths(source: Path) -> list[Path]:
    index = source / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [source / n for n in names]
    return [source / "model.safetensors"]


def drop_cache(paths: list[Path]) -> None:
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def raw_read(paths: list[Path], direct: bool) -> dict:
    """Cold sequential read of every shard with READ_CHUNK reads into one reused 4096-aligned buffer, through the
    page cache or around it (O_DIRECT)."""
    drop_cache(paths)
    owner = np.empty(READ_CHUNK + 4096, dtype=np.uint8)
    skip = -owner.ctypes.data % 4096
    view = memoryview(owner[skip : skip + READ_CHUNK])
    total = 0
    t = time.perf_counter()
    for p in paths:
        fd = os.open(p, os.O_RDONLY | (os.O_DIRECT if direct else 0))
        try:
            if not direct:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
            while True:
                n = os.readv(fd, [view])
                if n <= 0:
                    break
                total += n
        finally:
            os.close(fd)
    seconds = time.perf_counter() - t
    return {"bytes": total, "seconds": seconds, "gbps": total / 1e9 / seconds, "o_direct": direct}


def convert_once(source: Path, out: Path, paths: list[Path], workers: int) -> dict:
    shutil.rmtree(out, ignore_errors=True)
    drop_cache(paths)
    t = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-c", CHILD, str(source), str(out), str(workers)],
                            stdout=subprocess.PIPE, cwd=ROOT)
    stdout = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise SystemExit(f"conversion failed with exit code {proc.returncode}")
    inner = json.loads(stdout.decode().strip().splitlines()[-1])
    size = sum(p.stat().st_size for p in out.iterdir() if p.is_file())
    shutil.rmtree(out, ignore_errors=True)
    return {"wall_seconds": wall, "converter_seconds": inner["seconds"], "source_bytes": inner["source_bytes"],
            "gbps": inner["source_bytes"] / 1e9 / wall, "peak_rss_bytes": usage.ru_maxrss * 1024,
            "container_bytes": size, "user_seconds": usage.ru_utime, "system_seconds": usage.ru_stime}


def machine() -> dict:
    mem = {line.split(":")[0]: line.split()[1] for line in Path("/proc/meminfo").read_text().splitlines()}
    return {"cpus": os.cpu_count(), "ram_gb": round(int(mem["MemTotal"]) / 1024**2, 1),
            "cpu": next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                         if ln.startswith("model name")), platform.processor()),
            "python": platform.python_version()}


def disk_of(path: Path) -> str:
    best = ("", "")
    for line in Path("/proc/mounts").read_text().splitlines():
        dev, mnt = line.split()[:2]
        if str(path.resolve()).startswith(mnt) and len(mnt) > len(best[1]):
            best = (dev, mnt)
    return f"{best[0]} mounted at {best[1]}"


def commit() -> str:
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              check=False).stdout
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "convert", "colibri_format"], cwd=ROOT,
                               capture_output=True, text=True, check=False).stdout
        return head.strip() + ("+dirty" if dirty.strip() else "")
    except OSError:
        return "unknown"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--source", type=Path, default=Path("/work/benchdata/olmoe-random-8l"))
    ap.add_argument("--out", type=Path, default=Path("/work/benchdata/convert-throughput-out"))
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--workers", type=int, default=0, help="encoder threads (0: the converter's default)")
    ap.add_argument("--json", type=Path, default=OUT_JSON, help=f"where to write the figures (default {OUT_JSON})")
    args = ap.parse_args(argv)
    paths = shard_paths(args.source)
    shard_sizes = [p.stat().st_size for p in paths]
    load_before = os.getloadavg()
    raws, directs, convs = [], [], []
    for i in range(args.repeats):
        raws.append(raw_read(paths, direct=False))
        directs.append(raw_read(paths, direct=True))
        convs.append(convert_once(args.source, args.out, paths, args.workers))
        c = convs[-1]
        print(f"round {i + 1}: raw read {raws[-1]['gbps']:.3f} GB/s (O_DIRECT {directs[-1]['gbps']:.3f}), "
              f"conversion {c['gbps']:.3f} GB/s, {c['user_seconds'] + c['system_seconds']:.1f} CPU s, "
              f"peak RSS {c['peak_rss_bytes'] / 1e9:.2f} GB", flush=True)
    buffered_gbps = statistics.median(r["gbps"] for r in raws)
    direct_gbps = statistics.median(r["gbps"] for r in directs)
    raw_gbps = max(buffered_gbps, direct_gbps)
    conv_gbps = statistics.median(c["gbps"] for c in convs)
    cpu_per_gb = statistics.median((c["user_seconds"] + c["system_seconds"]) / (c["source_bytes"] / 1e9)
                                   for c in convs)
    peak_rss = max(c["peak_rss_bytes"] for c in convs)
    result = {
        "benchmark": "convert_throughput", "machine": machine(), "disk": disk_of(args.source), "commit": commit(),
        "command": " ".join([Path(sys.executable).name, "bench/convert_throughput.py", *(argv or sys.argv[1:])]),
        "cache": "cold source (fsync + posix_fadvise DONTNEED before every read and every conversion)",
        "load_average_before": load_before, "load_average_after": os.getloadavg(),
        "source": str(args.source), "source_bytes": sum(shard_sizes), "shards": len(paths),
        "largest_shard_bytes": max(shard_sizes), "repeats": args.repeats, "workers": args.workers or "default",
        "raw_read_buffered": raws, "raw_read_direct": directs, "conversions": convs,
        "median_raw_read_buffered_gbps": buffered_gbps, "median_raw_read_direct_gbps": direct_gbps,
        "raw_read_gbps": raw_gbps, "median_conversion_gbps": conv_gbps,
        "ratio_to_raw_read": conv_gbps / raw_gbps, "ratio_to_buffered_read": conv_gbps / buffered_gbps,
        "conversion_cpu_seconds_per_gb": cpu_per_gb, "peak_rss_bytes": peak_rss,
        "peak_rss_over_largest_shard": peak_rss / max(shard_sizes),
    }
    m = result["machine"]
    rows = [
        ("machine", f"{m['cpus']} CPUs ({m['cpu']}), {m['ram_gb']} GB RAM, {result['disk']}"),
        ("load average", f"{load_before[0]:.1f} before, {result['load_average_after'][0]:.1f} after"),
        ("commit", result["commit"]),
        ("command", result["command"]),
        ("cache state", result["cache"]),
        ("source", (f"{args.source} ({sum(shard_sizes) / 1e9:.2f} GB in {len(paths)} shards, largest "
                    f"{max(shard_sizes) / 1e9:.2f} GB)")),
        (f"raw read (median of {args.repeats})", (f"{buffered_gbps:.3f} GB/s through the page cache, "
                                                   f"{direct_gbps:.3f} GB/s O_DIRECT")),
        (f"conversion (median of {args.repeats})",
         f"{conv_gbps:.3f} GB/s of source read, {statistics.median(c['wall_seconds'] for c in convs):.1f} s wall"),
        ("ratio to raw read", (f"{result['ratio_to_raw_read']:.2f} x the faster raw read, "
                               f"{result['ratio_to_buffered_read']:.2f} x the page-cache read")),
        ("conversion CPU", f"{cpu_per_gb:.1f} CPU s per GB of source (user + system)"),
        ("peak RSS of conversion", (f"{peak_rss / 1e9:.2f} GB = {result['peak_rss_over_largest_shard']:.2f} x "
                                    "the largest shard")),
        ("container", f"{convs[0]['container_bytes'] / 1e9:.2f} GB"),
    ]
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
