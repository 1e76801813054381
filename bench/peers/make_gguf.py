"""A Q4_0 GGUF of a Hugging Face checkpoint, made with llama.cpp's own tools, for the llama.cpp peer.

Two steps, both llama.cpp's: its converter (`convert_hf_to_gguf.py`, with its `conversion/` package and `gguf-py/`,
as shipped in llama-cpp-python's source distribution) writes a bf16 GGUF; the library's `llama_model_quantize`
(exposed by `llama_cpp`) turns that into Q4_0 (the closest llama.cpp type to int4 gs64: blocks of 32 weights with
one f16 scale). The bf16 file is deleted afterwards.

The converter identifies a BPE tokenizer's pre-tokenizer by hashing how it splits a test string, and refuses one it
does not know. The random-weight checkpoints of `make_random_checkpoint.py` carry a small byte-level BPE tokenizer
with GPT-2's pre-tokenizer (`ByteLevel`, `use_regex`), which we declare as `--pre gpt-2` instead of hashing.

    python bench/peers/make_gguf.py CHECKPOINT OUT.gguf [--llama-src DIR] [--pre gpt-2]

Get the converter once with
    pip download llama-cpp-python==<installed version> --no-deps --no-binary :all: -d /work/llama-src
and untar it there; `--llama-src` points at its `vendor/llama.cpp` (found automatically under /work/llama-src).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

DEFAULT_SRC_ROOT = Path("/work/llama-src")

# Run inside the child: declare the pre-tokenizer, then hand over to the converter's own main().
_CONVERT = """
import sys
src, pre = sys.argv[1], sys.argv[2]
sys.path.insert(0, src)
sys.path.insert(1, src + "/gguf-py")
from conversion import base
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: pre
import convert_hf_to_gguf
sys.argv = ["convert_hf_to_gguf.py"] + sys.argv[3:]
convert_hf_to_gguf.main()
"""


class GGUFUnavailable(RuntimeError):
    """llama.cpp's converter or llama_cpp itself is missing."""


def find_llama_src(explicit: Path | None = None) -> Path:
    """The `vendor/llama.cpp` folder of an unpacked llama-cpp-python source distribution."""
    candidates = [explicit] if explicit else sorted(DEFAULT_SRC_ROOT.glob("llama_cpp_python-*/vendor/llama.cpp"))
    for c in candidates:
        if c and (c / "convert_hf_to_gguf.py").is_file() and (c / "gguf-py").is_dir():
            return c
    raise GGUFUnavailable(
        f"llama.cpp's converter not found (looked in {explicit or DEFAULT_SRC_ROOT}); get it with `pip download "
        "llama-cpp-python==<version> --no-deps --no-binary :all: -d /work/llama-src` and untar it there")


def convert_bf16(checkpoint: Path, out: Path, src: Path, pre: str) -> float:
    t = time.perf_counter()
    cmd = [sys.executable, "-c", _CONVERT, str(src), pre, str(checkpoint), "--outtype", "bf16", "--outfile", str(out)]
    env = dict(os.environ, PYTHONPATH=f"{src / 'gguf-py'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        tail = "\n".join(done.stderr.strip().splitlines()[-5:])
        raise GGUFUnavailable(f"llama.cpp's converter failed:\n{tail}")
    return time.perf_counter() - t


def quantize_q4_0(src: Path, out: Path, threads: int) -> float:
    try:
        import llama_cpp
    except ImportError as exc:
        raise GGUFUnavailable(f"llama_cpp is not installed ({exc}); pip install llama-cpp-python") from None
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_0
    params.nthread = threads
    t = time.perf_counter()
    tmp = out.with_name(out.name + ".partial")
    rc = llama_cpp.llama_model_quantize(str(src).encode(), str(tmp).encode(), params)
    if rc != 0:
        tmp.unlink(missing_ok=True)
        raise GGUFUnavailable(f"llama_model_quantize returned {rc}")
    os.replace(tmp, out)
    return time.perf_counter() - t


def make_q4_0(checkpoint: Path, out: Path, src: Path | None = None, pre: str = "gpt-2", threads: int = 2) -> dict:
    """Write `out` (Q4_0) unless it exists; returns what was done and how long it took."""
    if out.is_file():
        return {"gguf": str(out), "reused": True, "bytes": out.stat().st_size}
    llama_src = find_llama_src(src)
    out.parent.mkdir(parents=True, exist_ok=True)
    bf16 = out.with_name(out.stem + ".bf16.gguf")
    try:
        convert_s = convert_bf16(checkpoint, bf16, llama_src, pre)
        quantize_s = quantize_q4_0(bf16, out, threads)
    finally:
        bf16.unlink(missing_ok=True)
    return {"gguf": str(out), "reused": False, "bytes": out.stat().st_size, "converter": str(llama_src),
            "pre_tokenizer": pre, "convert_bf16_s": convert_s, "quantize_q4_0_s": quantize_s}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("checkpoint", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("--llama-src", type=Path, default=None)
    ap.add_argument("--pre", default="gpt-2", help="pre-tokenizer name declared to the converter")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    try:
        info = make_q4_0(args.checkpoint, args.out, args.llama_src, args.pre, args.threads)
    except GGUFUnavailable as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(info)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
