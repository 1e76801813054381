"""The model shipped with Colibri: the front door works, the shipped container is exactly what converting the
trained checkpoint gives, and the runtime agrees with transformers on its real (trained) weights."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import runtime_oracle
from typer.testing import CliRunner

from colibri_runtime.cli import app
from colibri_runtime.runner import DEFAULT_MODEL_DIR

CHECKPOINT = Path(__file__).resolve().parents[1] / "models" / "colibri-tiny"


def test_generate_runs_the_default_model_with_no_arguments():
    result = CliRunner().invoke(app, ["generate", "--max-tokens", "8", "--chat", "What is a list?"])
    assert result.exit_code == 0, result.output
    assert result.stdout.strip()
    assert "decode" in result.stderr


def test_chat_runs_the_default_model_with_no_arguments():
    result = CliRunner().invoke(app, ["chat", "--max-tokens", "6"], input="hello\n/quit\n")
    assert result.exit_code == 0, result.output
    assert "colibri-tiny (glm_moe_dsa" in result.stderr and "tok/s" in result.stderr


def test_shipped_container_is_the_conversion_of_the_trained_checkpoint(tmp_path):
    from colibri_convert.convert import convert
    from colibri_convert.sources import open_source

    out = tmp_path / "default"
    convert(open_source(str(CHECKPOINT), None), out, None, progress=None)
    shipped = sorted(p.name for p in DEFAULT_MODEL_DIR.iterdir() if not p.name.startswith("."))
    assert shipped == sorted(p.name for p in out.iterdir())
    for name in shipped:
        if name == "colibri.json":  # names the source folder it was converted from
            continue
        assert (out / name).read_bytes() == (DEFAULT_MODEL_DIR / name).read_bytes(), name


def test_runtime_matches_transformers_on_the_trained_weights(tmp_path):
    from colibri_convert.export import export_hf
    from colibri_runtime.loader import load_model

    reference = runtime_oracle.tiny_models.load_reference_model(export_hf(DEFAULT_MODEL_DIR, tmp_path / "hf"))
    model = load_model(DEFAULT_MODEL_DIR)
    from colibri_runtime.tokenizer import ChatTokenizer

    ids = np.array(ChatTokenizer(DEFAULT_MODEL_DIR, model.config).encode(
        "A dictionary maps keys to values. The list type is mutable, and a tuple is not: you cannot assign to "
        "an item of a tuple, but you can build a new one from slices of the old."))[:32]
    assert len(ids) == 32
    ours = model.prefill(ids, model.new_state(), all_logits=True)
    theirs = runtime_oracle.reference_logits(reference, ids)
    assert ours.shape == theirs.shape
    top2 = np.sort(theirs, axis=-1)[:, -2:]
    decided = (top2[:, 1] - top2[:, 0]) >= 1e-4  # positions that are not near-ties
    assert (ours.argmax(-1) == theirs.argmax(-1))[decided].all()
    # The same tolerance as the family oracle tests (tests/test_runtime_oracle.py): float32 reductions in another
    # order differ by ~1e-6 of the logits' scale; 2e-5 leaves room without hiding a wrong scale or mask.
    assert np.abs(ours - theirs).max() <= 2e-5 * np.abs(theirs).max()
