"""One engine's decode measurement, run in a child process of bench/suite.py (one engine per process, so no two
share RAM, and a process can be put in a memory cgroup before it loads anything).

    python bench/peers/engines.py '{"engine": "colibri", "model": DIR, "threads": 2, ...}'

Engines: `colibri` (colibri_runtime.runner.Runner, in process), `transformers` (AutoModelForCausalLM on the CPU,
optionally with accelerate disk offload: device_map="auto", max_memory, offload_folder) and `llama_cpp`
(llama-cpp-python on a GGUF, mmap). Every engine runs the same protocol: load once; one warm-up run; `repeats` timed
runs, each prefilling the same prompt ids then decoding `new` tokens one forward at a time: greedily, or with
"forced" feeding a fixed random continuation (the same ids for every engine). Only the decode
steps are timed (tokens after the first / their wall time). Storage reads during the timed steps come from
/proc/self/io (`read_bytes`: page-cache misses, mmap faults and O_DIRECT reads alike). The last line printed is the
JSON result.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]


def prompt_ids(n: int, seed: int = 0) -> list[int]:
    """The suite's prompt: n random ids every model's vocabulary holds (byte tokens and specials excluded)."""
    return [int(t) for t in np.random.default_rng(seed).integers(300, 5000, n)]


def continuation(a: dict) -> list[int] | None:
    """With "forced", the ids fed at the decode steps (instead of each step's argmax): random weights make greedy
    decoding repeat one token, hence one set of experts, which hides the cost of streaming."""
    return prompt_ids(max(a["new"], a["warmup_new"]), seed=1) if a.get("forced") else None


def io_read_bytes() -> int:
    with open("/proc/self/io") as f:
        for line in f:
            if line.startswith("read_bytes:"):
                return int(line.split()[1])
    return 0


def peak_rss_bytes() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def timed_runs(decode, warmup_new: int, new: int, repeats: int) -> dict:
    """decode(n) -> (seconds of the n decode steps, tokens): one warm-up run, then `repeats` timed runs."""
    t = time.perf_counter()
    decode(warmup_new)
    warmup_s = time.perf_counter() - t
    runs = []
    for _ in range(repeats):
        before = io_read_bytes()
        seconds, tokens = decode(new)
        read = io_read_bytes() - before
        runs.append({"seconds": seconds, "tok_s": new / seconds, "read_bytes_per_token": read / new,
                     "tokens": tokens})
    tps = [r["tok_s"] for r in runs]
    med = statistics.median(tps)
    return {"tok_s": med, "tok_s_runs": tps, "read_bytes_per_token": statistics.median(
        r["read_bytes_per_token"] for r in runs), "warmup_s": warmup_s, "runs": runs, "tokens": runs[0]["tokens"],
        "peak_rss_bytes": peak_rss_bytes()}


# --- colibri ------------------------------------------------------------------------------------------------------


def run_colibri(a: dict) -> dict:
    import numba

    numba.set_num_threads(a["threads"])
    from colibri_runtime.kernels import warm_up
    from colibri_runtime.placement import PlacementOptions
    from colibri_runtime.runner import Runner

    warm_up()
    prompt = prompt_ids(a["prompt"])
    options = PlacementOptions(ram_gb=a.get("ram_gb"), direct=a.get("direct", "auto"), pin=a.get("pin", "auto"),
                               prefetch=a.get("prefetch", True), io_threads=a.get("io_threads", 4),
                               context_tokens=a["prompt"] + max(a["new"], a["warmup_new"]) + 16)
    trace = Path(a["trace"]) if a.get("trace") else None
    t = time.perf_counter()
    runner = Runner.open(Path(a["model"]), options, trace)
    if a.get("preload") and runner.budget.fits_all_experts:  # every expert in the tier cache before timing
        for layer in runner.container.expert_layers:
            runner.provider.get(layer, range(runner.container.num_experts))
    load_s = time.perf_counter() - t
    stats = runner.provider.stats
    counters: list[dict] = []

    gen = runner.generator
    forced = continuation(a)

    def decode(n: int):
        state = runner.model.new_state()
        tok = int(np.argmax(gen.step(state, prompt)))
        tokens = [tok]
        t_first = time.perf_counter()
        mark = dict(loaded=stats.loaded, hits=stats.hits, read=stats.bytes_read)
        for i in range(n):
            logits = gen.step(state, [forced[i] if forced else tok])
            tok = int(np.argmax(logits))
            tokens.append(tok)
        seconds = time.perf_counter() - t_first
        runner.end_turn()
        counters.append(dict(loaded=stats.loaded - mark["loaded"], hits=stats.hits - mark["hits"],
                             read=stats.bytes_read - mark["read"]))
        return seconds, tokens

    try:
        out = timed_runs(decode, a["warmup_new"], a["new"], a["repeats"])
        timed = counters[1:]
        loaded = sum(c["loaded"] for c in timed)
        b = runner.budget
        out.update({
            "load_s": load_s,
            "hit_rate": sum(c["hits"] for c in timed) / loaded if loaded else None,
            "expert_bytes_read_per_token": statistics.median(c["read"] for c in timed) / a["new"],
            "budget": {"total": b.total, "resident": b.resident, "kv": b.kv, "experts": b.experts,
                       "expert_bytes": b.expert_bytes, "moe_layers": b.moe_layers, "num_experts": b.num_experts,
                       "fits_all_experts": b.fits_all_experts},
            "cache_experts_per_layer": min(b.num_experts, b.experts // max(1, b.expert_bytes * b.moe_layers)),
            "direct": a.get("direct", "auto"),
        })
        out["bytes_per_token"] = colibri_bytes_per_token(runner.container)
    finally:
        runner.close()
    return out


def colibri_bytes_per_token(container) -> dict:
    """Packed bytes of weights one decode step reads: resident weights (one row of the embedding table) + top_k
    expert records per MoE layer."""
    resident, embed_row = 0, 0
    for name in container.tensor_names(group="resident"):
        qt = container.tensor(name)
        nbytes = int(qt.data.nbytes + (qt.scales.nbytes if qt.scales is not None else 0))
        if name.endswith("embed_tokens.weight"):
            embed_row = nbytes // int(qt.shape[0])
        else:
            resident += nbytes
    cfg = container.config
    top_k = int(cfg.get("num_experts_per_tok") or cfg.get("moe_top_k") or 8)
    expert = container.record_location(container.expert_layers[0], 0).length
    experts = len(container.expert_layers) * top_k * expert
    return {"resident": resident + embed_row, "experts": experts, "total": resident + embed_row + experts}


# --- transformers -------------------------------------------------------------------------------------------------


def run_transformers(a: dict) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(a["threads"])
    dtype = {"bf16": torch.bfloat16, "f32": torch.float32}[a.get("dtype", "bf16")]
    kwargs = {}
    if a.get("offload_folder"):
        Path(a["offload_folder"]).mkdir(parents=True, exist_ok=True)
        kwargs = dict(device_map="auto", max_memory={"cpu": int(a["max_memory_bytes"])},
                      offload_folder=a["offload_folder"])
    t = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(a["model"], dtype=dtype, **kwargs)
    model.eval()
    load_s = time.perf_counter() - t
    devices = {}
    for v in (getattr(model, "hf_device_map", None) or {}).values():
        devices[str(v)] = devices.get(str(v), 0) + 1
    prompt = prompt_ids(a["prompt"])
    forced = continuation(a)

    @torch.inference_mode()
    def decode(n: int):
        out = model(torch.tensor([prompt]), use_cache=True)
        past, tok = out.past_key_values, int(out.logits[0, -1].argmax())
        tokens = [tok]
        t0 = time.perf_counter()
        for i in range(n):
            out = model(torch.tensor([[forced[i] if forced else tok]]), past_key_values=past, use_cache=True)
            past, tok = out.past_key_values, int(out.logits[0, -1].argmax())
            tokens.append(tok)
        return time.perf_counter() - t0, tokens

    out = timed_runs(decode, a["warmup_new"], a["new"], a["repeats"])
    params = sum(p.numel() for p in model.parameters())
    out.update({"load_s": load_s, "dtype": a.get("dtype", "bf16"), "torch": torch.__version__,
                "torch_threads": torch.get_num_threads(), "parameters": int(params), "device_map_modules": devices})
    return out


# --- llama.cpp ----------------------------------------------------------------------------------------------------


def run_llama_cpp(a: dict) -> dict:
    import llama_cpp
    from llama_cpp import Llama

    if not a.get("extra_bufts", False):
        # llama.cpp's extra CPU buffer types (AMX, weight repacking) are off unless asked for: on this machine's
        # virtual CPU the AMX one crashes (SIGSEGV in ggml_backend_amx_mul_mat) at the first forward.
        defaults = llama_cpp.llama_cpp.llama_model_default_params

        def params_without_extra_bufts():
            p = defaults()
            p.use_extra_bufts = False
            return p

        llama_cpp.llama_cpp.llama_model_default_params = params_without_extra_bufts
    prompt = prompt_ids(a["prompt"])
    t = time.perf_counter()
    if a.get("preload"):  # the whole GGUF in the page cache before timing
        with open(a["model"], "rb", buffering=0) as f:
            while f.read(64 << 20):
                pass
    llm = Llama(model_path=a["model"], n_threads=a["threads"], n_threads_batch=a["threads"],
                n_ctx=a["prompt"] + max(a["new"], a["warmup_new"]) + 16, n_batch=max(32, a["prompt"]),
                use_mmap=True, seed=0, verbose=False)
    load_s = time.perf_counter() - t

    n_vocab = llm.n_vocab()
    forced = continuation(a)

    def last_logits() -> np.ndarray:  # Llama.eval keeps no scores unless logits_all: read the context's own
        return np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(n_vocab,))

    def decode(n: int):
        llm.reset()
        llm.eval(prompt)
        tok = int(np.argmax(last_logits()))
        tokens = [tok]
        t0 = time.perf_counter()
        for i in range(n):
            llm.eval([forced[i] if forced else tok])
            tok = int(np.argmax(last_logits()))
            tokens.append(tok)
        return time.perf_counter() - t0, tokens

    out = timed_runs(decode, a["warmup_new"], a["new"], a["repeats"])
    out.update({"load_s": load_s, "llama_cpp": llama_cpp.__version__, "gguf_bytes": os.path.getsize(a["model"]),
                "extra_bufts": bool(a.get("extra_bufts", False))})
    return out


ENGINES = {"colibri": run_colibri, "transformers": run_transformers, "llama_cpp": run_llama_cpp}


def main() -> int:
    args = json.loads(sys.argv[1])
    result = ENGINES[args["engine"]](args)
    result["io_read_bytes_total"] = io_read_bytes()
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
