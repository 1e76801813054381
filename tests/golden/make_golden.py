"""Build the golden tiny v1 container from fixed inputs.

    python tests/golden/make_golden.py          # rewrite tests/golden/tiny-v1 (only with a spec change!)

tests/test_format_golden.py rebuilds it in a temporary directory and compares every byte with the committed copy.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import numpy as np

from colibri_format.quant import quantize
from colibri_format.writer import ContainerWriter

GOLDEN_DIR = Path(__file__).with_name("tiny-v1")
CONFIG = {
    "model_type": "qwen3_moe",
    "hidden_size": 96,
    "moe_intermediate_size": 40,
    "num_experts": 2,
    "num_hidden_layers": 2,
    "vocab_size": 16,
}


def _values(seed: int, shape: tuple[int, ...]) -> np.ndarray:
    # Small exact binary fractions keep the inputs identical on every platform.
    rng = np.random.default_rng(seed)
    return (rng.integers(-64, 64, size=shape) / 32).astype(np.float32)


def build(out_dir: Path) -> Path:
    h, i = CONFIG["hidden_size"], CONFIG["moe_intermediate_size"]
    w = ContainerWriter(
        out_dir,
        family="qwen3_moe",
        config=CONFIG,
        source={"repo": "golden", "revision": "v1", "files": {}},
        recipe={"routed_experts": "int4_gs64", "embeddings": "int8_gs64", "norm": "f32"},
    )
    w.add_verbatim_file("generation_config.json", b'{"eos_token_id": 1}\n')
    w.add_tensor("model.embed_tokens.weight", quantize(_values(1, (16, h)), "int8_gs64"))
    w.add_tensor("model.norm.weight", quantize(_values(2, (h,)), "f32"))
    w.add_tensor("model.layers.0.self_attn.o_proj.weight", quantize(_values(3, (8, h)), "int4_gs64"))
    w.add_tensor("lm_head.weight", quantize(_values(4, (16, h)), "f16"))
    w.add_tensor("model.layers.2.eh_proj.weight", quantize(_values(5, (4, 8)), "bf16"), group="mtp")
    for layer in (0, 1):
        for expert in (0, 1):
            seed = 100 + 10 * layer + expert
            w.add_expert(
                layer,
                expert,
                gate=quantize(_values(seed, (i, h)), "int4_gs64"),
                up=quantize(_values(seed + 1000, (i, h)), "int4_gs64"),
                down=quantize(_values(seed + 2000, (h, i)), "int4_gs64"),
            )
    return w.finish()


if __name__ == "__main__":
    if GOLDEN_DIR.exists():
        shutil.rmtree(GOLDEN_DIR)
    build(GOLDEN_DIR)
    print(f"wrote {GOLDEN_DIR}", file=sys.stderr)
