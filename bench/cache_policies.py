"""Cache policies on the routing trace of a trained model: hit rates as fractions of Belady's optimum.

    python bench/cache_policies.py [--model DIR] [--text FILE] [--tokens 2000] [--capacity 0.25]

Runs the model (default: the model shipped with Colibri) over real text with `--trace`, then replays the trace
through LRU, LRU + pinning (learned on the first half, judged on the second), LRU + pinning + router-lookahead
prefetch, and Belady's optimal policy at the same per-layer capacity. Also reports how well router lookahead predicts
the next layer's experts, against the baseline "the same experts as the previous token".
Prints a table and writes bench/out/cache_policies.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

from colibri_inspect.replay import replay
from colibri_runtime.placement import PlacementOptions
from colibri_runtime.runner import Runner

DEFAULT_TEXT = [Path("specs/CONTAINER.md"), Path("specs/QUANT.md"), Path("README.md"), Path("bench/streaming.py")]


def trace_over_text(model: Path | None, text: str, tokens: int, trace_path: Path):
    options = PlacementOptions(prefetch=True, context_tokens=tokens + 16, direct="off")
    runner = Runner.open(model, options, trace_path)
    try:
        ids = runner.tokenizer.encode(text)[:tokens]
        limit = runner.model.max_positions
        state = runner.model.new_state()
        for start in range(0, len(ids), 128):
            if state.length + 128 > limit:
                state = runner.model.new_state()
            runner.generator.step(state, ids[start:start + 128])
        name = runner.model_dir.name
    finally:
        runner.close()
    from colibri_runtime.trace import RoutingTrace

    return RoutingTrace.load(trace_path), name, len(ids)


def prediction_quality(trace) -> dict:
    """Share of each layer's routed experts that lookahead predicted, and that the previous token used."""
    routed, predicted = trace.routed, trace.predicted
    lookahead_hits = lookahead_total = prev_hits = prev_total = 0
    for t in range(routed.shape[0]):
        for slot in range(routed.shape[1]):
            actual = set(routed[t, slot].tolist())
            pred = set(predicted[t, slot].tolist()) - {-1}
            if pred:
                lookahead_hits += len(actual & pred)
                lookahead_total += len(actual)
            if t > 0:
                prev_hits += len(actual & set(routed[t - 1, slot].tolist()))
                prev_total += len(actual)
    return {
        "lookahead_recall": lookahead_hits / lookahead_total if lookahead_total else 0.0,
        "previous_token_recall": prev_hits / prev_total if prev_total else 0.0,
    }


def expert_load(trace) -> dict:
    """Token share of the busiest expert and coefficient of variation of the load, per layer."""
    out = {}
    for slot, layer in enumerate(trace.layers):
        counts = np.bincount(trace.routed[:, slot].reshape(-1), minlength=trace.num_experts).astype(float)
        share = counts / counts.sum()
        out[str(layer)] = {"max_share": float(share.max()), "cv": float(share.std() / share.mean())}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=None)
    ap.add_argument("--text", type=Path, action="append", default=None)
    ap.add_argument("--tokens", type=int, default=2000)
    ap.add_argument("--capacity", type=float, default=0.25)
    ap.add_argument("--json", type=Path, default=Path("bench/out/cache_policies.json"))
    args = ap.parse_args()
    text = "\n\n".join(p.read_text() for p in (args.text or DEFAULT_TEXT))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    trace, name, n = trace_over_text(args.model, text, args.tokens, args.json.with_suffix(".trace"))
    results = replay(trace, capacity_fraction=args.capacity)
    belady = next(r for r in results if r.policy == "belady")
    quality = prediction_quality(trace)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    print(f"model {name}: {n} tokens of real text, {len(trace.layers)} MoE layers x {trace.num_experts} experts, "
          f"top-{trace.top_k}; capacity {args.capacity:.0%} = {belady.capacity} experts per layer")
    print(f"{'policy':<20}{'hit rate':>10}{'x Belady':>10}")
    for r in results:
        print(f"{r.policy:<20}{100 * r.hit_rate:>9.1f}%{r.hit_rate / belady.hit_rate:>10.2f}")
    print(f"router lookahead predicts {100 * quality['lookahead_recall']:.1f}% of the next layer's experts; "
          f"the previous token's experts cover {100 * quality['previous_token_recall']:.1f}%")
    args.json.write_text(json.dumps({
        "commit": commit, "command": " ".join(sys.argv), "machine": {"cpus": os.cpu_count()},
        "model": name, "tokens": n, "capacity_fraction": args.capacity, "capacity": belady.capacity,
        "policies": {r.policy: {"hit_rate": r.hit_rate, "x_belady": r.hit_rate / belady.hit_rate,
                                "accesses": r.accesses} for r in results},
        "prediction": quality, "expert_load": expert_load(trace),
    }, indent=2))
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
