"""Measure the reconstruction error of int4 group-64 code mappings and scale dtypes (specs/QUANT.md, rationale).

    python bench/quant_options.py [--rows 2048 --cols 4096] [--json bench/out/quant_options.json]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

GROUP = 64


def _divide(g, s):
    return np.divide(g, s, out=np.zeros_like(g), where=s != 0)


def absmax7(g, sdt):
    s = (np.abs(g).max(1, keepdims=True) / 7).astype(sdt).astype(np.float32)
    return np.clip(np.rint(_divide(g, s)), -7, 7) * s


def absmax75(g, sdt):
    s = (np.abs(g).max(1, keepdims=True) / 7.5).astype(sdt).astype(np.float32)
    return np.clip(np.rint(_divide(g, s)), -8, 7) * s


def signed_max8(g, sdt):
    m = g[np.arange(len(g)), np.abs(g).argmax(1)][:, None]
    s = (m / -8).astype(sdt).astype(np.float32)
    return np.clip(np.rint(_divide(g, s)), -8, 7) * s


def scale_search(g, sdt):
    best = err = None
    amax = np.abs(g).max(1, keepdims=True)
    for div in np.linspace(6.5, 8.5, 9):
        for sign in (1, -1):
            s = (sign * amax / div).astype(sdt).astype(np.float32)
            r = np.clip(np.rint(_divide(g, s)), -8, 7) * s
            e = ((r - g) ** 2).sum(1, keepdims=True)
            if best is None:
                best, err = r, e
            else:
                better = e < err
                best, err = np.where(better, r, best), np.where(better, e, err)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=2048)
    ap.add_argument("--cols", type=int, default=4096)
    ap.add_argument("--json", type=Path, default=Path("bench/out/quant_options.json"))
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    dists = {
        "gaussian": rng.standard_normal((args.rows, args.cols)).astype(np.float32),
        "student_t4": rng.standard_t(4, (args.rows, args.cols)).astype(np.float32),
    }
    scale_dtypes = {"f32": np.float32, "f16": np.float16}
    try:
        import ml_dtypes

        scale_dtypes["bf16"] = ml_dtypes.bfloat16
    except ImportError:
        pass
    results = []
    print(f"{'mapping':<14}{'scales':<8}" + "".join(f"{d:>14}" for d in dists) + f"{'seconds':>10}")
    for fn in (absmax7, absmax75, signed_max8, scale_search):
        for sname, sdt in scale_dtypes.items():
            row = {"mapping": fn.__name__, "scale_dtype": sname}
            t0 = time.perf_counter()
            for dname, w in dists.items():
                g = w.reshape(-1, GROUP)
                r = fn(g, sdt)
                row[dname] = float(np.sqrt(((r - g) ** 2).mean()) / np.sqrt((g**2).mean()))
            row["seconds"] = time.perf_counter() - t0
            results.append(row)
            print(f"{fn.__name__:<14}{sname:<8}" + "".join(f"{row[d]:>14.4f}" for d in dists) + f"{row['seconds']:>10.2f}")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(results, indent=2))
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
