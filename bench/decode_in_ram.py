"""Decode speed with every routed expert in RAM, against transformers on the CPU and the memory-bandwidth bound.

The model is a real-dimension random checkpoint (OLMoE-1B-7B shapes, `bench/make_random_checkpoint.py`) and its
Colibri container (`colibri-convert convert`). Colibri: the runtime's model with a MemoryExpertProvider holding every
expert of every layer, read into process memory and prepared for the kernels before timing (so nothing is read from
storage while decoding). transformers: the bf16 checkpoint, `torch.set_num_threads` equal to the numba threads, in a
child process (so the two never share RAM). Both decode the same greedy continuation loop by hand: prefill a random
prompt of `--prompt` tokens, then time `--new` single-token forward steps with the attention cache. One warm-up run,
then `--repeats` timed runs; the median counts.

Memory bound: tok/s <= read bandwidth / bytes of weights touched per token, where the bytes are the packed resident
weights a token reads (every resident matrix except the embedding table, of which it reads one row, plus the lm_head)
and `top_k` experts per MoE layer, and the bandwidth is a read-only reduction measured in the same run at the same
thread count (bench/kernels.py's `memory_bandwidth`).

    python bench/decode_in_ram.py --container DIR --checkpoint DIR [--threads 2] [--prompt 16] [--new 32]
        [--repeats 3] [--json bench/out/decode_in_ram.json] [--no-peer]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))


def prompt_ids(vocab: int, n: int, seed: int = 0) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(300, vocab, n)]


# --- colibri ------------------------------------------------------------------------------------------------------


def load_all_experts(container):
    """Every expert record copied into process memory and prepared for the kernels."""
    from colibri_runtime.weights import MemoryExpertProvider

    records = {}
    for layer in container.expert_layers:
        for e in range(container.num_experts):
            buf = bytearray(container.record_bytes(layer, e))
            records[(layer, e)] = container.decode_record(memoryview(buf), layer, e)
    provider = MemoryExpertProvider(records)
    for layer in container.expert_layers:
        provider.get(layer, list(range(container.num_experts)))
    return provider


def _stored_bytes(qt) -> int:
    return int(qt.data.nbytes + (qt.scales.nbytes if qt.scales is not None else 0))


def bytes_per_token(container, top_k: int) -> dict:
    """Packed bytes of weights one decode step reads (see the module docstring)."""
    resident, embed_row = 0, 0
    for name in container.tensor_names(group="resident"):
        qt = container.tensor(name)
        if name.endswith("embed_tokens.weight"):
            embed_row = _stored_bytes(qt) // int(qt.shape[0])
        else:
            resident += _stored_bytes(qt)
    rec = container.expert(container.expert_layers[0], 0)
    expert = sum(_stored_bytes(q) for q in (rec.gate, rec.up, rec.down))
    experts = len(container.expert_layers) * top_k * expert
    return {"resident_bytes": resident, "embedding_row_bytes": embed_row, "expert_bytes": expert,
            "experts_bytes": experts, "total_bytes": resident + embed_row + experts}


def decode_colibri(model, prompt: list[int], new: int) -> tuple[float, list[int]]:
    state = model.new_state()
    logits = model.prefill(prompt, state)
    tok = int(np.argmax(logits[-1] if logits.ndim == 2 else logits))
    out = [tok]
    t = time.perf_counter()
    for _ in range(new):
        logits = model.forward([[tok]], [state])[0]
        tok = int(np.argmax(logits[-1] if logits.ndim == 2 else logits))
        out.append(tok)
    return new / (time.perf_counter() - t), out


def run_colibri(args) -> dict:
    import numba
    from colibri_runtime.kernels import warm_up
    from colibri_runtime.loader import load_model, open_container
    from kernels import memory_bandwidth

    numba.set_num_threads(args.threads)
    warm_up()
    container = open_container(args.container)
    t = time.perf_counter()
    provider = load_all_experts(container)
    load_s = time.perf_counter() - t
    model = load_model(args.container, experts=provider, container=container)
    cfg = container.config
    prompt = prompt_ids(int(cfg["vocab_size"]), args.prompt)
    decode_colibri(model, prompt, args.new)  # warm-up: compiles, touches every resident page
    runs = [decode_colibri(model, prompt, args.new) for _ in range(args.repeats)]
    tps = [r[0] for r in runs]
    top_k = int(cfg.get("num_experts_per_tok") or cfg.get("moe_top_k") or 8)
    touched = bytes_per_token(container, top_k)
    bw = memory_bandwidth(args.repeats)
    bound = bw["read_gbps"] * 1e9 / touched["total_bytes"]
    return {"tok_s_runs": tps, "tok_s": float(np.median(tps)), "tokens": runs[0][1],
            "experts_load_s": load_s, "bytes_per_token": touched, "memory": bw, "memory_bound_tok_s": bound,
            "vs_memory_bound": float(np.median(tps)) / bound}


# --- transformers (child process) ---------------------------------------------------------------------------------


def run_peer(args) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(args.threads)
    dtype = {"bf16": torch.bfloat16, "f32": torch.float32}[args.peer_dtype]
    model = AutoModelForCausalLM.from_pretrained(args.checkpoint, dtype=dtype)
    model.eval()
    prompt = prompt_ids(int(model.config.vocab_size), args.prompt)

    @torch.inference_mode()
    def decode():
        ids = torch.tensor([prompt])
        out = model(ids, use_cache=True)
        past = out.past_key_values
        tok = int(out.logits[0, -1].argmax())
        toks = [tok]
        t = time.perf_counter()
        for _ in range(args.new):
            out = model(torch.tensor([[tok]]), past_key_values=past, use_cache=True)
            past = out.past_key_values
            tok = int(out.logits[0, -1].argmax())
            toks.append(tok)
        return args.new / (time.perf_counter() - t), toks

    decode()
    runs = [decode() for _ in range(args.repeats)]
    tps = [r[0] for r in runs]
    return {"dtype": args.peer_dtype, "tok_s_runs": tps, "tok_s": float(np.median(tps)), "tokens": runs[0][1],
            "torch": torch.__version__, "torch_threads": torch.get_num_threads()}


def peer_in_child(args, dtype: str) -> dict:
    cmd = [sys.executable, __file__, "--peer-only", "--peer-dtype", dtype, "--checkpoint", str(args.checkpoint),
           "--threads", str(args.threads), "--prompt", str(args.prompt), "--new", str(args.new),
           "--repeats", str(args.repeats)]
    done = subprocess.run(cmd, check=False, capture_output=True, text=True)
    if done.returncode != 0:
        return {"dtype": dtype, "error": done.stderr.strip().splitlines()[-1:] or ["failed"]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--container", type=Path, default=Path("/work/benchdata/olmoe-random-8l-colibri"))
    ap.add_argument("--checkpoint", type=Path, default=Path("/work/benchdata/olmoe-random-8l"))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt", type=int, default=16, help="prompt tokens (random ids)")
    ap.add_argument("--new", type=int, default=32, help="decoded tokens per timed run")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--peer-dtype", nargs="+", default=["bf16"], help="transformers dtypes (bf16, f32)")
    ap.add_argument("--no-peer", action="store_true", help="skip transformers")
    ap.add_argument("--peer-only", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--json", type=Path, default=ROOT / "bench" / "out" / "decode_in_ram.json")
    args = ap.parse_args()
    if args.peer_only:
        args.peer_dtype = args.peer_dtype[0]
        print(json.dumps(run_peer(args)))
        return
    load_before = os.getloadavg()
    colibri = run_colibri(args)
    peers = [] if args.no_peer else [peer_in_child(args, d) for d in args.peer_dtype]
    cfg = json.loads((args.container / "config.json").read_text())
    doc = {
        "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                    "ram_gb": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9},
        "commit": commit(), "command": " ".join([Path(sys.argv[0]).name] + sys.argv[1:]),
        "cache": "warm: every expert copied into process memory and prepared; one warm-up decode before timing",
        "model": {"container": str(args.container), "checkpoint": str(args.checkpoint),
                  "layers": cfg.get("num_hidden_layers"), "hidden": cfg.get("hidden_size"),
                  "experts": cfg.get("num_experts"), "top_k": cfg.get("num_experts_per_tok")},
        "threads": args.threads, "prompt_tokens": args.prompt, "new_tokens": args.new, "repeats": args.repeats,
        "load_average": [load_before, os.getloadavg()], "colibri": colibri, "transformers": peers,
    }
    for p in peers:
        if "tok_s" in p:
            p["colibri_ratio"] = colibri["tok_s"] / p["tok_s"]
    c = colibri
    print(f"model: {doc['model']['layers']} layers, OLMoE-1B-7B shapes; threads {args.threads}; prompt {args.prompt} "
          f"tokens, {args.new} decoded; median of {args.repeats}; load average {load_before[0]:.1f}")
    print(f"memory read bandwidth {c['memory']['read_gbps']:.1f} GB/s; weights touched per token "
          f"{c['bytes_per_token']['total_bytes'] / 1e6:.0f} MB -> bound {c['memory_bound_tok_s']:.1f} tok/s")
    print(f"{'engine':<24} {'tok/s':>8} {'colibri x':>10}")
    print(f"{'colibri (int4 experts)':<24} {c['tok_s']:>8.2f} {'':>10}  = {c['vs_memory_bound']:.2f} x memory bound")
    for p in peers:
        if "tok_s" in p:
            print(f"{'transformers ' + p['dtype']:<24} {p['tok_s']:>8.2f} {p['colibri_ratio']:>10.2f}")
        else:
            print(f"{'transformers ' + p['dtype']:<24} failed: {p['error']}")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(doc, indent=2) + "\n")
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
