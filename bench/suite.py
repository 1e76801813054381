"""The benchmark suite: colibri-run against its peers and against the physical limits, side by side, in one run.

    python bench/suite.py            # full run (about 5 minutes on 2 cores once the models exist)
    python bench/suite.py --quick    # fewer tokens, one timed run per engine, OLMoE shapes only

Models (real dimensions, random weights; built here if missing, else reused):
- `olmoe`: OLMoE-1B-7B shapes, 8 of 16 layers (`make_random_checkpoint.py --layers 8`, 7.1 GB bf16), its container
  (`colibri-convert convert`) and a Q4_0 GGUF made with llama.cpp's own converter and quantizer (`peers/gguf.py`).
- `deepseek_v3`: DeepSeek-V3's structure (MLA, sigmoid routing with correction bias, a shared expert, the first layer
  dense) scaled to hidden 2048 and 64 experts (`--family deepseek_v3 --layers 8`, 4.2 GB bf16) and its container.

Settings (each engine in its own child process, `peers/engines.py`, same prompt ids, same thread count, greedy):
- `in RAM`: every weight in memory, warm. colibri (int4 gs64 experts, every expert cached after the warm-up),
  transformers bf16 (and f32 with `--f32`), llama.cpp Q4_0 (mmap, page cache warm).
- `budget B GiB`: the process runs in a cgroup v1 memory group limited to B GiB, which charges the page cache too, so
  the disk is really read. transformers + accelerate disk offload (device_map="auto", max_memory={"cpu": half of
  B}, offload_folder), colibri (`--ram` B less 0.5 GiB for the interpreter), llama.cpp Q4_0 (mmap).
- `stream b GiB`: a smaller group, below colibri's container size: colibri streams experts with O_DIRECT through its
  tier cache; llama.cpp pages its GGUF in and out.
The files of each model are dropped from the page cache (posix_fadvise DONTNEED) before each cgroup run: pages cached
outside the group would otherwise be read without being charged to it.

Protocol per engine: load, one warm-up run, `--repeats` timed runs (median counts); each run prefills `--prompt`
random ids and decodes `--new` tokens (`--offload-new` for the disk-offload peer, which is ~20 x slower); only the
decode steps are timed. In RAM the decode is greedy. In the budget and stream rows each step feeds the next id of a
fixed random continuation instead (same ids for every engine; `--greedy` turns this off): random weights make greedy
decoding repeat one token, hence the same experts at every step, and the smallest cache then looks as good as RAM. Limits, measured in the same run at the same thread count:
- memory bound: read bandwidth (a read-only integer reduction over 1 GiB on the numba threads, bench/kernels.py)
  / bytes of weights one decode step reads in that engine's format (resident weights, one embedding row, top_k
  experts per MoE layer);
- disk bound: raw O_DIRECT read bandwidth (whole expert records at random on the runtime's I/O threads, and large
  sequential reads; bench/streaming.py) / bytes read from storage per decoded token (/proc/self/io of the engine);
- cache bound: the routing trace of colibri's streaming run replayed through LRU, pinning, lookahead prefetch and
  Belady's optimum at the same per-layer capacity (colibri_inspect.replay, as bench/cache_policies.py does).

A peer that is unavailable (package missing, converter missing, no cgroup, out of memory) is skipped with a message.
Prints a table, writes bench/out/suite.json, bench/out/suite.md (the table) and bench/out/suite.png.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
sys.path.insert(0, str(BENCH))
sys.path.insert(0, str(BENCH / "peers"))

DATA = Path("/work/benchdata")
CGROUP_ROOT = Path("/sys/fs/cgroup/memory")
GIB = 1024**3
INTERPRETER_RESERVE_GIB = 0.5


@dataclass
class Model:
    key: str
    family: str
    layers: int
    checkpoint: Path
    container: Path
    gguf: Path | None
    notes: list[str] = field(default_factory=list)


def models(data: Path, layers: int) -> dict[str, Model]:
    return {
        "olmoe": Model("olmoe", "olmoe", layers, data / f"olmoe-random-{layers}l",
                       data / f"olmoe-random-{layers}l-colibri", data / f"olmoe-random-{layers}l-Q4_0.gguf"),
        "deepseek_v3": Model("deepseek_v3", "deepseek_v3", layers, data / f"deepseek_v3-random-{layers}l",
                             data / f"deepseek_v3-random-{layers}l-colibri", None),
    }


def log(msg: str) -> None:
    print(msg, flush=True)


# --- preparing the models -----------------------------------------------------------------------------------------


def ensure_checkpoint(m: Model) -> None:
    if (m.checkpoint / "model.safetensors.index.json").is_file():
        return
    log(f"building {m.checkpoint} (random weights)")
    subprocess.run([sys.executable, str(BENCH / "make_random_checkpoint.py"), "--family", m.family, "--layers",
                    str(m.layers), "--out", str(m.checkpoint)], check=True)


def ensure_container(m: Model) -> None:
    if (m.container / "colibri.json").is_file():
        return
    log(f"converting {m.checkpoint} -> {m.container}")
    exe = shutil.which("colibri-convert") or str(Path(sys.executable).with_name("colibri-convert"))
    subprocess.run([exe, "convert", "--quiet", str(m.checkpoint), str(m.container)], check=True)


def ensure_gguf(m: Model, threads: int) -> str | None:
    """None when the GGUF is there; otherwise why the llama.cpp peer is skipped."""
    if m.gguf is None:
        return "no GGUF for this model (llama.cpp's converter is run on the OLMoE-shaped model only)"
    try:
        import llama_cpp  # noqa: F401
    except ImportError as exc:
        return f"llama_cpp not installed ({exc}); pip install llama-cpp-python"
    from make_gguf import GGUFUnavailable, make_q4_0

    try:
        info = make_q4_0(m.checkpoint, m.gguf, threads=threads)
    except GGUFUnavailable as exc:
        return str(exc).splitlines()[0]
    if not info["reused"]:
        log(f"wrote {m.gguf}: bf16 GGUF in {info['convert_bf16_s']:.0f} s, Q4_0 in {info['quantize_q4_0_s']:.0f} s")
    return None


def model_files(m: Model) -> list[Path]:
    files = [p for d in (m.checkpoint, m.container) for p in d.iterdir() if p.is_file()]
    return files + ([m.gguf] if m.gguf and m.gguf.is_file() else [])


def drop_page_cache(paths) -> None:
    for p in paths:
        try:
            fd = os.open(p, os.O_RDONLY)
        except OSError:
            continue
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


# --- limits -------------------------------------------------------------------------------------------------------


def measure_limits(m: Model, threads: int, repeats: int, raw_gb: float, io_threads: int) -> dict:
    import numba
    from kernels import memory_bandwidth
    from streaming import raw_record_bandwidth, sequential_bandwidth

    from colibri_format.reader import Container

    numba.set_num_threads(threads)
    mem = memory_bandwidth(max(3, repeats))
    container = Container.open(m.container)
    try:
        files = [container.path / f for f in container.files_of_role("experts")]
        drop_page_cache(files)
        records = raw_record_bandwidth(container, io_threads, int(raw_gb * 1e9))
        drop_page_cache(files)
        seq = sequential_bandwidth(files, int(raw_gb * 1e9))
    finally:
        container.close()
    return {"memory_read_gbps": mem["read_gbps"], "numpy_sum_gbps": mem["numpy_sum_gbps"],
            "disk_record_read_gbps": records, "disk_sequential_read_gbps": seq, "threads": threads,
            "io_threads": io_threads}


# --- bytes of weights per decoded token, per format ---------------------------------------------------------------


def hf_bytes_per_token(checkpoint: Path, parameters: int, dtype_bytes: int) -> int:
    c = json.loads((checkpoint / "config.json").read_text())
    experts = int(c.get("num_experts") or c.get("n_routed_experts"))
    top_k = int(c["num_experts_per_tok"])
    width = int(c.get("moe_intermediate_size") or c["intermediate_size"])
    moe_layers = int(c["num_hidden_layers"]) - int(c.get("first_k_dense_replace", 0))
    idle = moe_layers * (experts - top_k) * 3 * width * int(c["hidden_size"])
    embed_rest = (int(c["vocab_size"]) - 1) * int(c["hidden_size"])
    return dtype_bytes * (parameters - idle - embed_rest)


def gguf_bytes_per_token(gguf_path: Path, checkpoint: Path) -> int | None:
    try:
        from make_gguf import find_llama_src

        sys.path.insert(0, str(find_llama_src() / "gguf-py"))
        from gguf.gguf_reader import GGUFReader  # llama.cpp's gguf-py package
    except Exception:
        return None
    c = json.loads((checkpoint / "config.json").read_text())
    experts = int(c.get("num_experts") or c.get("n_routed_experts"))
    top_k = int(c["num_experts_per_tok"])
    total = 0
    for t in GGUFReader(str(gguf_path)).tensors:
        n = int(t.n_bytes)
        if "_exps." in t.name:
            n = n * top_k // experts
        elif t.name.startswith("token_embd"):
            n = n // int(t.shape[-1])
        total += n
    return total


# --- running an engine in a child process -------------------------------------------------------------------------


class MemoryGroup:
    """A cgroup v1 memory group limiting a child (RSS and page cache) to `limit` bytes."""

    def __init__(self, name: str, limit: int) -> None:
        self.path = CGROUP_ROOT / name
        self.limit = limit

    @staticmethod
    def available() -> str | None:
        if not (CGROUP_ROOT / "memory.limit_in_bytes").is_file():
            return f"no cgroup v1 memory controller at {CGROUP_ROOT}"
        if not os.access(CGROUP_ROOT, os.W_OK):
            return f"{CGROUP_ROOT} is not writable (needs root)"
        return None

    def __enter__(self):
        self.path.mkdir(exist_ok=True)
        (self.path / "memory.limit_in_bytes").write_text(str(self.limit))
        with contextlib.suppress(OSError):
            (self.path / "memory.max_usage_in_bytes").write_text("0")
        return self

    def join(self) -> None:  # runs in the child between fork and exec
        with open(self.path / "cgroup.procs", "w") as f:
            f.write(str(os.getpid()))

    def stats(self) -> dict:
        def read(name):
            try:
                return int((self.path / name).read_text().split()[0])
            except (OSError, ValueError):
                return None

        return {"limit_bytes": self.limit, "max_usage_bytes": read("memory.max_usage_in_bytes"),
                "failcnt": read("memory.failcnt")}

    def __exit__(self, *exc) -> None:
        for _ in range(50):
            try:
                self.path.rmdir()
                return
            except OSError:
                time.sleep(0.1)


def run_engine(spec: dict, group: MemoryGroup | None = None, timeout: float = 1200) -> dict:
    cmd = [sys.executable, str(BENCH / "peers" / "engines.py"), json.dumps(spec)]
    env = dict(os.environ, OMP_NUM_THREADS=str(spec["threads"]), NUMBA_NUM_THREADS=str(spec["threads"]),
               TOKENIZERS_PARALLELISM="false", PYTHONWARNINGS="ignore")
    t = time.perf_counter()
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout,
                              preexec_fn=group.join if group else None)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    wall = time.perf_counter() - t
    if done.returncode != 0:
        if done.returncode in (-9, 137):
            return {"error": "killed (out of memory in its group?)", "wall_s": wall}
        lines = [ln for ln in done.stderr.strip().splitlines() if ln.strip()]
        return {"error": (lines[-1] if lines else f"exit {done.returncode}")[:300], "wall_s": wall}
    result = json.loads(done.stdout.strip().splitlines()[-1])
    result["wall_s"] = wall
    return result


# --- the suite ----------------------------------------------------------------------------------------------------


def rows_for(m: Model, args, llama_skip: str | None, cgroup_skip: str | None) -> list[dict]:
    """The (setting, engine, spec) rows of one model."""
    new = args.new if m.key == "olmoe" else max(8, args.new // 2)  # the DeepSeek-shaped model is slower
    base = {"threads": args.threads, "prompt": args.prompt, "new": new, "warmup_new": args.warmup_new,
            "repeats": args.repeats, "extra_bufts": args.llama_extra_bufts}
    rows = []

    def add(setting, engine, label, spec=None, skip=None, budget=None):
        spec = dict(base, engine=engine, forced=budget is not None and not args.greedy, **(spec or {}))
        rows.append({"model": m.key, "setting": setting, "engine": engine, "label": label, "spec": spec,
                     "skip": skip, "budget_gib": budget})

    ram = "in RAM"
    add(ram, "colibri", "colibri int4", {"model": str(m.container), "preload": True})
    add(ram, "transformers", "transformers bf16", {"model": str(m.checkpoint), "dtype": "bf16"})
    if args.f32:
        add(ram, "transformers", "transformers f32", {"model": str(m.checkpoint), "dtype": "f32"})
    add(ram, "llama_cpp", "llama.cpp Q4_0", {"model": str(m.gguf), "preload": True}, skip=llama_skip)
    if m.key != "olmoe" or args.no_budget:
        return rows
    b = args.budget_gb
    setting = f"budget {b:g} GiB"
    offload = {"model": str(m.checkpoint), "dtype": "bf16", "max_memory_bytes": int(b * GIB * args.offload_cpu_share),
               "offload_folder": str(args.offload_folder), "new": args.offload_new, "warmup_new": 1}
    add(setting, "transformers", "transformers bf16 + accelerate offload", offload, skip=cgroup_skip, budget=b)
    add(setting, "colibri", "colibri int4", {"model": str(m.container), "ram_gb": b - INTERPRETER_RESERVE_GIB},
        skip=cgroup_skip, budget=b)
    add(setting, "llama_cpp", "llama.cpp Q4_0", {"model": str(m.gguf)}, skip=llama_skip or cgroup_skip, budget=b)
    s = args.stream_gb
    setting = f"stream {s:g} GiB"
    add(setting, "colibri", "colibri int4", {"model": str(m.container), "ram_gb": s - INTERPRETER_RESERVE_GIB,
                                             "trace": str(args.out / f"suite-{m.key}.trace")},
        skip=cgroup_skip, budget=s)
    add(setting, "llama_cpp", "llama.cpp Q4_0", {"model": str(m.gguf)}, skip=llama_skip or cgroup_skip, budget=s)
    return rows


def run_row(row: dict, m: Model) -> dict:
    log(f"[{row['model']} | {row['setting']}] {row['label']} ...")
    if row["skip"]:
        log(f"  skipped: {row['skip']}")
        return {"skipped": row["skip"]}
    if row["engine"] == "colibri":
        (m.container / ".coli_usage").unlink(missing_ok=True)  # every run learns its hot set from scratch
    if row["budget_gib"]:
        drop_page_cache(model_files(m))
        name = f"colibri-suite-{os.getpid()}"
        with MemoryGroup(name, int(row["budget_gib"] * GIB)) as group:
            result = run_engine(row["spec"], group)
            result["cgroup"] = group.stats()
    else:
        result = run_engine(row["spec"])
    if row["spec"].get("offload_folder"):  # accelerate copies the offloaded weights there (6 GB for olmoe)
        shutil.rmtree(row["spec"]["offload_folder"], ignore_errors=True)
    if "error" in result:
        log(f"  failed: {result['error']}")
    else:
        log(f"  {result['tok_s']:.2f} tok/s (runs {', '.join(f'{x:.2f}' for x in result['tok_s_runs'])}), "
            f"{result['read_bytes_per_token'] / 2**20:.1f} MiB read from storage per token")
    return result


def add_bounds(row: dict, m: Model, limits: dict) -> None:
    r = row["result"]
    if "tok_s" not in r:
        return
    if row["engine"] == "colibri":
        per_token = r["bytes_per_token"]["total"]
    elif row["engine"] == "transformers":
        per_token = hf_bytes_per_token(m.checkpoint, r["parameters"], 4 if r["dtype"] == "f32" else 2)
    else:
        per_token = gguf_bytes_per_token(m.gguf, m.checkpoint)
    if per_token:
        r["weight_bytes_per_token"] = per_token
        r["memory_bound_tok_s"] = limits["memory_read_gbps"] * 1e9 / per_token
        r["x_memory_bound"] = r["tok_s"] / r["memory_bound_tok_s"]
    read = r["read_bytes_per_token"]
    if read > 1e6:  # storage really read while decoding
        raw = max(limits["disk_record_read_gbps"], limits["disk_sequential_read_gbps"])
        r["disk_bound_tok_s"] = raw * 1e9 / read
        r["x_disk_bound"] = r["tok_s"] / r["disk_bound_tok_s"]
        r["achieved_read_gbps"] = read * r["tok_s"] / 1e9


def cache_bound(rows: list[dict], out: Path) -> dict | None:
    """Replay colibri's streaming trace through the policies and Belady at colibri's per-layer capacity."""
    row = next((r for r in rows if r["engine"] == "colibri" and r["spec"].get("trace") and "tok_s" in r["result"]),
               None)
    if row is None:
        return None
    from colibri_inspect.replay import replay
    from colibri_runtime.trace import RoutingTrace

    trace = RoutingTrace.load(Path(row["spec"]["trace"]))
    per_layer = row["result"]["cache_experts_per_layer"]
    results = replay(trace, capacity_fraction=per_layer / trace.num_experts)
    belady = next(x for x in results if x.policy == "belady")
    doc = {"model": row["model"], "setting": row["setting"], "trace_tokens": trace.tokens,
           "capacity_per_layer": belady.capacity, "num_experts": trace.num_experts,
           "policies": {x.policy: {"hit_rate": x.hit_rate, "x_belady": x.hit_rate / belady.hit_rate if belady.hit_rate
                                   else None} for x in results},
           "colibri_measured_hit_rate": row["result"]["hit_rate"]}
    if belady.hit_rate and row["result"]["hit_rate"] is not None:
        doc["colibri_measured_x_belady"] = row["result"]["hit_rate"] / belady.hit_rate
    return doc


def ratios(rows: list[dict]) -> None:
    """colibri's tok/s over each engine's, within each (model, setting)."""
    for row in rows:
        r = row["result"]
        ref = next((x["result"] for x in rows if x["model"] == row["model"] and x["setting"] == row["setting"]
                    and x["engine"] == "colibri"), None)
        if ref and "tok_s" in ref and "tok_s" in r:
            r["colibri_x"] = ref["tok_s"] / r["tok_s"]


# --- reporting ----------------------------------------------------------------------------------------------------


def fmt(x, spec: str, empty: str = "-") -> str:
    return empty if x is None else format(x, spec)


def table(rows: list[dict]) -> list[str]:
    head = ["model", "setting", "engine", "tok/s", "colibri ÷ engine", "x memory bound", "MiB read/token",
            "x disk bound", "peak RSS GiB"]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    for row in rows:
        r = row["result"]
        if "tok_s" not in r:
            why = f"skipped: {r['skipped']}" if "skipped" in r else f"failed: {r.get('error')}"
            lines.append(f"| {row['model']} | {row['setting']} | {row['label']} | {why} | | | | | |")
            continue
        read = r["read_bytes_per_token"] / 2**20
        lines.append(
            f"| {row['model']} | {row['setting']} | {row['label']} | {r['tok_s']:.2f}"
            f" | {fmt(r.get('colibri_x'), '.2f')} | {fmt(r.get('x_memory_bound'), '.2f')} | {read:.1f}"
            f" | {fmt(r.get('x_disk_bound'), '.2f')}"
            f" | {r['peak_rss_bytes'] / GIB:.2f} |")
    return lines


def plot(rows: list[dict], limits: dict, path: Path) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        return f"no plot: {exc}"
    done = [r for r in rows if "tok_s" in r["result"]]
    if not done:
        return "no plot: nothing measured"
    colors = {"colibri": "#d62728", "transformers": "#1f77b4", "llama_cpp": "#2ca02c"}
    fig, ax = plt.subplots(figsize=(10, 0.45 * len(done) + 1.8))
    labels = [f"{r['model']} | {r['setting']} | {r['label']}" for r in done]
    y = np.arange(len(done))[::-1]
    ax.barh(y, [r["result"]["tok_s"] for r in done], color=[colors[r["engine"]] for r in done])
    for yi, r in zip(y, done):
        res = r["result"]
        if res.get("memory_bound_tok_s"):
            ax.plot(res["memory_bound_tok_s"], yi, "k|", markersize=14)
        if res.get("disk_bound_tok_s"):
            ax.plot(res["disk_bound_tok_s"], yi, "kx", markersize=7)
        ax.text(res["tok_s"], yi, f" {res['tok_s']:.2f}", va="center", fontsize=8)
    ax.set_yticks(y, labels, fontsize=8)
    ax.set_xscale("log")
    ax.set_xlabel("decode tok/s (log scale); | memory bound, x disk bound of the same engine")
    ax.set_title(f"Colibri vs peers, {limits['threads']} threads; memory {limits['memory_read_gbps']:.1f} GB/s, "
                 f"disk {max(limits['disk_record_read_gbps'], limits['disk_sequential_read_gbps']):.2f} GB/s",
                 fontsize=10)
    ax.grid(axis="x", which="both", alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


def machine() -> dict:
    disk = subprocess.run(["findmnt", "-no", "SOURCE,FSTYPE", "--target", str(DATA)], capture_output=True,
                          text=True).stdout.strip()
    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError, StopIteration), open("/proc/cpuinfo") as f:
        cpu = next(ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name"))
    return {"cpu": cpu, "cores": os.cpu_count(), "ram_gb": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
            / 1e9, "disk": disk, "platform": platform.platform()}


def commit() -> str:
    out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT, capture_output=True,
                           text=True).stdout.strip()
    return (out.stdout.strip() or "unknown") + (" (working tree modified)" if dirty else "")


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true",
                    help="8 prompt + 8 decoded tokens, 1 timed run, 2 for the offload peer; OLMoE shapes only")
    ap.add_argument("--models", nargs="+", choices=["olmoe", "deepseek_v3"], default=None)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--data", type=Path, default=DATA, help="where the checkpoints, containers and GGUFs live")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt", type=int, default=16)
    ap.add_argument("--new", type=int, default=32, help="decoded tokens per timed run (half for deepseek_v3)")
    ap.add_argument("--warmup-new", type=int, default=8)
    ap.add_argument("--offload-new", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--budget-gb", type=float, default=3.0, help="GiB of the memory group of the budget rows")
    ap.add_argument("--stream-gb", type=float, default=1.5, help="GiB of the memory group of the streaming rows")
    ap.add_argument("--offload-cpu-share", type=float, default=0.5,
                    help="share of the budget given to accelerate as max_memory['cpu']")
    ap.add_argument("--offload-folder", type=Path, default=Path("/work/benchdata/offload"))
    ap.add_argument("--f32", action="store_true", help="also transformers f32 in RAM (needs ~2 x the bf16 RAM)")
    ap.add_argument("--llama-extra-bufts", action="store_true",
                    help="let llama.cpp use its extra CPU buffer types (AMX, weight repacking); off by default "
                         "because AMX crashes on this machine's virtual CPU")
    ap.add_argument("--greedy", action="store_true",
                    help="decode greedily in the budget and stream rows too (default: a forced random continuation)")
    ap.add_argument("--no-budget", action="store_true", help="skip the cgroup rows")
    ap.add_argument("--raw-gb", type=float, default=1.0, help="GB read for each raw disk bandwidth measurement")
    ap.add_argument("--io-threads", type=int, default=4)
    ap.add_argument("--out", type=Path, default=BENCH / "out")
    args = ap.parse_args(argv)
    if args.quick:
        args.prompt, args.new, args.warmup_new, args.repeats, args.offload_new = 8, 8, 4, 1, 2
        args.raw_gb = min(args.raw_gb, 0.5)
    args.models = args.models or (["olmoe"] if args.quick else ["olmoe", "deepseek_v3"])
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    started = time.time()
    load_before = os.getloadavg()
    all_models = models(args.data, args.layers)
    cgroup_skip = MemoryGroup.available()
    doc = {"machine": machine(), "commit": commit(), "command": " ".join(["python", "bench/suite.py"] + sys.argv[1:]),
           "started": time.strftime("%Y-%m-%d %H:%M:%S"), "threads": args.threads, "prompt_tokens": args.prompt,
           "new_tokens": args.new, "offload_new_tokens": args.offload_new, "repeats": args.repeats,
           "cache_state": "warm: one warm-up run per engine before the timed runs; the budget and stream rows run in "
                          "a cgroup v1 memory group (page cache charged) with the model files dropped from the page "
                          "cache before each engine starts",
           "models": {}, "rows": []}
    mach = doc["machine"]
    log(f"machine: {mach['cores']} cores, {mach['ram_gb']:.1f} GB RAM, disk {mach['disk']}; commit {doc['commit']}; "
        f"load average {load_before[0]:.1f}")
    rows = []
    for key in args.models:
        m = all_models[key]
        ensure_checkpoint(m)
        ensure_container(m)
        llama_skip = ensure_gguf(m, args.threads)
        if llama_skip:
            log(f"llama.cpp peer skipped for {key}: {llama_skip}")
        limits = measure_limits(m, args.threads, args.repeats, args.raw_gb, args.io_threads)
        log(f"limits ({key} files): memory read {limits['memory_read_gbps']:.1f} GB/s on {args.threads} threads; disk "
            f"{limits['disk_record_read_gbps']:.2f} GB/s random records on {args.io_threads} threads, "
            f"{limits['disk_sequential_read_gbps']:.2f} GB/s sequential (O_DIRECT)")
        cfg = json.loads((m.checkpoint / "config.json").read_text())
        doc["models"][key] = {"checkpoint": str(m.checkpoint), "container": str(m.container),
                              "gguf": str(m.gguf) if m.gguf else None, "config": cfg, "limits": limits,
                              "checkpoint_bytes": sum(p.stat().st_size for p in m.checkpoint.glob("*.safetensors")),
                              "container_bytes": sum(p.stat().st_size for p in m.container.iterdir() if p.is_file()),
                              "gguf_bytes": m.gguf.stat().st_size if m.gguf and m.gguf.is_file() else None}
        model_rows = rows_for(m, args, llama_skip, cgroup_skip)
        for row in model_rows:
            row["load_average"] = os.getloadavg()[0]
            row["result"] = run_row(row, m)
            add_bounds(row, m, limits)
        rows += model_rows
        doc["models"][key]["cache_bound"] = cache_bound(model_rows, args.out)
    ratios(rows)
    doc["rows"] = [{k: v for k, v in r.items()} for r in rows]
    doc["load_average"] = [load_before, os.getloadavg()]
    doc["wall_s"] = time.time() - started
    lines = table(rows)
    log("")
    log("\n".join(lines))
    for key, info in doc["models"].items():
        cb = info.get("cache_bound")
        if cb:
            pol = ", ".join(f"{p} {100 * v['hit_rate']:.1f}%" for p, v in cb["policies"].items())
            log(f"cache bound ({key}, {cb['setting']}, {cb['capacity_per_layer']} of {cb['num_experts']} experts per "
                f"layer, {cb['trace_tokens']} tokens): {pol}; colibri measured "
                f"{fmt(cb['colibri_measured_hit_rate'] and 100 * cb['colibri_measured_hit_rate'], '.1f')}% = "
                f"{fmt(cb.get('colibri_measured_x_belady'), '.2f')} x Belady")
    why = plot(rows, next(iter(doc["models"].values()))["limits"], args.out / "suite.png")
    if why:
        log(why)
    (args.out / "suite.json").write_text(json.dumps(doc, indent=2) + "\n")
    (args.out / "suite.md").write_text("\n".join(lines) + "\n")
    log(f"wrote {args.out / 'suite.json'}, {args.out / 'suite.md'}, {args.out / 'suite.png'}; "
        f"{doc['wall_s'] / 60:.1f} min; load average {doc['load_average'][1][0]:.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
