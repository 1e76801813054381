"""Decode from a container larger than the RAM budget, with the page cache out of play, against the disk bound.

    python bench/streaming.py --container /work/benchdata/olmoe-random-8l-colibri --ram 1.0 [--tokens 24]

Measured in one run:
- raw disk bandwidth: O_DIRECT reads of whole expert records at random, on as many threads as the runtime uses
  (the runtime's own access pattern), and large sequential O_DIRECT reads for reference;
- decode tok/s of colibri-run (in process, O_DIRECT on, so the page cache holds no expert) under several policies;
- missed bytes per token, hence the disk bound: raw bandwidth / missed bytes per token;
- achieved read GB/s: bytes read / wall time with at least one read in flight.
Prints a table and writes bench/out/streaming.json. Median of --repeats decode runs per policy.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import platform
import random
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from colibri_format.reader import Container
from colibri_runtime.generate import peak_rss_bytes, rss_bytes
from colibri_runtime.placement import PlacementOptions
from colibri_runtime.runner import Runner

POLICIES = {
    "lru": dict(pin="0", prefetch=False),
    "lru+prefetch": dict(pin="0", prefetch=True),
    "lru+pin+prefetch": dict(pin="auto", prefetch=True),
}


def _commit() -> str:
    out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return out.stdout.strip() or "unknown"


def drop_page_cache(paths) -> None:
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def raw_record_bandwidth(container: Container, threads: int, budget_bytes: int, seed: int = 0) -> float:
    """GB/s of O_DIRECT reads of whole expert records in random order on `threads` threads."""
    locs = [loc for _, _, loc in container.iter_records()]
    random.Random(seed).shuffle(locs)
    picked, total = [], 0
    for loc in locs:
        if total >= budget_bytes:
            break
        picked.append(loc)
        total += loc.padded_length
    fds = {f: os.open(container.path / f, os.O_RDONLY | os.O_DIRECT) for f in {loc.file for loc in picked}}
    size = max(loc.padded_length for loc in picked)

    def work(chunk):
        buf = mmap.mmap(-1, size)
        n = 0
        for loc in chunk:
            n += os.preadv(fds[loc.file], [memoryview(buf)[: loc.padded_length]], loc.offset)
        return n

    chunks = [picked[i::threads] for i in range(threads)]
    t0 = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        got = sum(pool.map(work, chunks))
    seconds = time.perf_counter() - t0
    for fd in fds.values():
        os.close(fd)
    return got / seconds / 1e9


def sequential_bandwidth(paths, budget_bytes: int, block: int = 16 * 1024 * 1024) -> float:
    buf = mmap.mmap(-1, block)
    got, t0 = 0, time.perf_counter()
    for p in paths:
        fd = os.open(p, os.O_RDONLY | os.O_DIRECT)
        try:
            offset = 0
            while got < budget_bytes:
                n = os.preadv(fd, [buf], offset)
                if n <= 0:
                    break
                got += n
                offset += n
        finally:
            os.close(fd)
        if got >= budget_bytes:
            break
    return got / (time.perf_counter() - t0) / 1e9


def decode_run(container_dir: Path, options: PlacementOptions, prompt: list[int], continuation: list[int]) -> dict:
    """Prefill `prompt`, then decode by feeding `continuation` one token per forward (a forced continuation: greedy
    decoding of random weights repeats one token, which would make every cache look perfect)."""
    runner = Runner.open(container_dir, options)
    try:
        provider, reader = runner.provider, runner.provider.reader
        gen = runner.generator
        state = runner.model.new_state()
        gen.step(state, prompt)
        s = provider.stats
        marks = dict(bytes=s.bytes_read, busy=reader.busy_seconds, loaded=s.loaded, hits=s.hits,
                     wait=s.disk_wait_seconds, pred=s.predicted, used=s.predicted_used, wanted=s.wanted_after_hint)
        t0 = time.perf_counter()
        for token in continuation:
            gen.step(state, [token])
        wall = time.perf_counter() - t0
        steps = len(continuation)
        read = s.bytes_read - marks["bytes"]
        busy = reader.busy_seconds - marks["busy"]
        loaded = s.loaded - marks["loaded"]
        predicted = s.predicted - marks["pred"]
        runner.end_turn()
        return {
            "decode_tokens": steps,
            "decode_seconds": wall,
            "tok_s": steps / wall,
            "missed_bytes_per_token": read / steps,
            "read_gbps_busy": read / busy / 1e9 if busy else 0.0,
            "read_gbps_wall": read / wall / 1e9,
            "hit_rate": (s.hits - marks["hits"]) / loaded if loaded else 0.0,
            "disk_wait_fraction": (s.disk_wait_seconds - marks["wait"]) / wall,
            "prefetch_precision": (s.predicted_used - marks["used"]) / predicted if predicted else None,
            "prefetch_recall": (s.predicted_used - marks["used"]) / (s.wanted_after_hint - marks["wanted"])
            if predicted else None,
            "cache_bytes": provider.cached_bytes,
            "budget_experts_bytes": runner.budget.experts,
            "container_expert_bytes": runner.budget.expert_bytes * runner.budget.moe_layers * runner.budget.num_experts,
            "rss_bytes": rss_bytes(),
            "peak_rss_bytes": peak_rss_bytes(),
        }
    finally:
        runner.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--container", type=Path, default=Path("/work/benchdata/olmoe-random-8l-colibri"))
    ap.add_argument("--ram", type=float, default=1.0, help="RAM budget in GB given to the runtime")
    ap.add_argument("--tokens", type=int, default=24)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--io-threads", type=int, default=4)
    ap.add_argument("--raw-gb", type=float, default=1.0, help="GB read for each raw bandwidth measurement")
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--json", type=Path, default=Path("bench/out/streaming.json"))
    args = ap.parse_args()

    container = Container.open(args.container)
    expert_files = [container.path / f for f in container.files_of_role("experts")]
    rng = np.random.default_rng(0)
    prompt = [int(t) for t in rng.integers(300, 5000, size=16)]
    continuation = [int(t) for t in rng.integers(300, 5000, size=args.tokens)]
    usage = container.path / ".coli_usage"
    usage.unlink(missing_ok=True)
    results = {
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                    "ram_gb": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9},
        "commit": _commit(),
        "command": " ".join(sys.argv),
        "cache_state": "cold: experts read with O_DIRECT; the resident weights are memory-mapped",
        "container": str(args.container),
        "ram_budget_gb": args.ram,
        "policies": {},
    }
    drop_page_cache(expert_files)
    raw_random = raw_record_bandwidth(container, args.io_threads, int(args.raw_gb * 1e9))
    raw_seq = sequential_bandwidth(expert_files, int(args.raw_gb * 1e9))
    results["raw_record_read_gbps"] = raw_random
    results["raw_sequential_read_gbps"] = raw_seq
    print(f"raw disk: {raw_random:.2f} GB/s random whole-record O_DIRECT reads on {args.io_threads} threads, "
          f"{raw_seq:.2f} GB/s sequential 16 MiB reads")
    # Pinning learns from a history of other text: one run on another prompt writes .coli_usage, and every measured
    # run starts from that same history (so no run learns from the prompt it is measured on).
    other = np.random.default_rng(1)
    decode_run(args.container, PlacementOptions(ram_gb=args.ram, direct="on", pin="0", prefetch=False,
                                                context_tokens=256),
               [int(t) for t in other.integers(300, 5000, size=16)],
               [int(t) for t in other.integers(300, 5000, size=args.tokens)])
    learned = usage.read_bytes()
    print(f"{'policy':<18}{'tok/s':>8}{'disk bound':>12}{'x bound':>9}{'MiB/tok':>9}{'read GB/s':>11}"
          f"{'x raw':>7}{'hit':>7}{'prefetch P/R':>14}")
    for name in args.policies.split(","):
        runs = []
        for _ in range(args.repeats):
            usage.write_bytes(learned)
            drop_page_cache(expert_files)
            options = PlacementOptions(ram_gb=args.ram, direct="on", io_threads=args.io_threads,
                                       context_tokens=256, **POLICIES[name])
            runs.append(decode_run(args.container, options, prompt, continuation))
        med = {k: statistics.median(r[k] for r in runs) for k in runs[0] if isinstance(runs[0][k], (int, float))}
        bound = raw_random * 1e9 / med["missed_bytes_per_token"] if med["missed_bytes_per_token"] else float("inf")
        med["disk_bound_tok_s"] = bound
        med["x_disk_bound"] = med["tok_s"] / bound
        med["x_raw_read"] = med["read_gbps_busy"] / raw_random
        results["policies"][name] = {"median": med, "runs": runs}
        pr = (f"{100 * runs[0]['prefetch_precision']:.0f}%/{100 * runs[0]['prefetch_recall']:.0f}%"
              if runs[0]["prefetch_precision"] is not None else "-")
        print(f"{name:<18}{med['tok_s']:>8.2f}{bound:>12.2f}{med['x_disk_bound']:>9.2f}"
              f"{med['missed_bytes_per_token'] / 2**20:>9.1f}{med['read_gbps_busy']:>11.2f}{med['x_raw_read']:>7.2f}"
              f"{100 * med['hit_rate']:>6.0f}%{pr:>14}")
    results["peak_rss_bytes"] = peak_rss_bytes()
    print(f"peak RSS of the process {peak_rss_bytes() / 2**30:.2f} GiB with a --ram budget of {args.ram:.2f} GB "
          f"(container experts {runs[0]['container_expert_bytes'] / 2**30:.2f} GiB)")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(results, indent=2))
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
