"""The `.coli_kv` session file: exact layout, round trip, crash consistency, refusal of bad files, resume rules."""

from __future__ import annotations

import struct
import warnings
import zlib

import numpy as np
import pytest
from colibri_runtime import session as S

from colibri_format.errors import SidecarError

FP = "ab" * 32
OTHER_FP = "cd" * 32
WIDTHS = (5, 3)


def layout(fp=FP, widths=WIDTHS, tag="dsa=sparse"):
    return S.SessionLayout(fp, widths, tag)


def states(n, seed=0):
    return np.random.default_rng(seed).standard_normal((n, sum(WIDTHS))).astype(np.float32)


@pytest.fixture(autouse=True)
def _state_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("COLIBRI_STATE_DIR", str(tmp_path / "state"))


def test_golden_layout(tmp_path):
    path = tmp_path / "s.coli_kv"
    f = S.SessionFile.create(path, layout())
    st = states(2)
    f.append([7, 9], st)
    f.close()
    raw = path.read_bytes()
    assert len(raw) == 4096 + 2 * (12 + 4 * 8)
    assert raw[:8] == b"COLIKV01"
    assert struct.unpack_from("<IIIIII", raw, 8) == (1, 4096, 1, 2, 12 + 32, 0)
    assert raw[32:64] == bytes.fromhex(FP)
    assert struct.unpack_from("<II", raw, 96) == WIDTHS
    assert struct.unpack_from("<I", raw, 104)[0] == zlib.crc32(raw[:104])
    assert raw[108:4064] == bytes(4064 - 108)
    assert struct.unpack_from("<QI", raw, 4064) == (2, zlib.crc32(struct.pack("<Q", 2)))
    rec1 = raw[4096 + 44 : 4096 + 88]
    assert struct.unpack_from("<II", rec1) == (9, 0)
    assert struct.unpack_from("<I", raw, 4096 + 4)[0] == S.FLAG_STEP_START
    assert np.array_equal(np.frombuffer(rec1[8:40], "<f4"), st[1])
    assert struct.unpack_from("<I", rec1, 40)[0] == zlib.crc32(rec1[:40])


def test_round_trip_and_resume_rules(tmp_path):
    path = tmp_path / "s.coli_kv"
    opened = S.open_session(path, layout(), [1, 2, 3])
    assert opened.status == "new" and opened.feed == [1, 2, 3]
    st = states(5)
    opened.file.append([1, 2, 3], st[:3])  # prefill step
    opened.file.append([4], st[3:4])  # decode steps
    opened.file.append([5], st[4:5])
    opened.file.close()

    longer = S.open_session(path, layout(), [1, 2, 3, 4, 5, 6, 7])
    assert longer.status == "resumed" and longer.reuse == 5 and longer.feed == [6, 7]
    assert np.array_equal(longer.states, st)
    assert np.array_equal(longer.layer_states(1), st[:, 5:8])
    longer.file.close()

    same = S.open_session(
        path, layout(), [1, 2, 3, 4, 5]
    )  # continue an interrupted answer: redo the last step
    assert same.status == "resumed" and same.reuse == 4 and same.feed == [5]
    same.file.append([5], st[4:5])
    same.file.close()

    prompt_only = S.SessionFile.create(tmp_path / "p.coli_kv", layout())
    prompt_only.append([1, 2, 3], st[:3])
    prompt_only.close()
    again = S.open_session(tmp_path / "p.coli_kv", layout(), [1, 2, 3])
    assert again.reuse == 0 and again.feed == [1, 2, 3]  # the whole last step is fed again
    again.file.close()


def test_uncommitted_tail_is_ignored(tmp_path):
    """A crash between appending records and committing the count leaves the previous, consistent content."""
    path = tmp_path / "s.coli_kv"
    f = S.SessionFile.create(path, layout())
    st = states(4)
    f.append([1, 2], st[:2])
    f.close()
    with open(path, "ab") as g:  # records written, count never committed
        g.write(b"\x55" * (44 + 17))
    opened = S.open_session(path, layout(), [1, 2, 3])
    assert opened.status == "resumed" and opened.reuse == 2
    assert path.stat().st_size == 4096 + 2 * 44  # the stale tail is cut
    opened.file.append([3], st[2:3])
    opened.file.close()
    assert S.read_session_file(path, layout()).tokens.tolist() == [1, 2, 3]


def _corrupt(path, offset, value=b"\xff"):
    raw = bytearray(path.read_bytes())
    raw[offset : offset + len(value)] = value
    path.write_bytes(bytes(raw))


@pytest.mark.parametrize(
    "damage",
    [
        "truncated",
        "record_crc",
        "header_crc",
        "commit_crc",
        "magic",
        "version",
        "other_model",
        "other_dims",
        "other_tag",
        "other_tokens",
        "empty_file",
    ],
)
def test_bad_file_starts_fresh_with_warning(tmp_path, damage):
    path = tmp_path / "s.coli_kv"
    f = S.SessionFile.create(path, layout())
    f.append([1, 2, 3], states(3))
    f.close()
    lay, prompt = layout(), [1, 2, 3, 4]
    if damage == "truncated":
        path.write_bytes(path.read_bytes()[:-10])
    elif damage == "record_crc":
        _corrupt(path, 4096 + 44 + 12)
    elif damage == "header_crc":
        _corrupt(path, 100)
    elif damage == "commit_crc":
        _corrupt(path, 4064, struct.pack("<Q", 2))
    elif damage == "magic":
        _corrupt(path, 0, b"X")
    elif damage == "version":
        _corrupt(path, 8, struct.pack("<I", 2))
    elif damage == "other_model":
        lay = layout(fp=OTHER_FP)
    elif damage == "other_dims":
        lay = layout(widths=(4, 4))
    elif damage == "other_tag":
        lay = layout(tag="dsa=all")
    elif damage == "other_tokens":
        prompt = [7, 5, 3, 4]
    elif damage == "empty_file":
        path.write_bytes(b"")
    with pytest.warns(S.SessionWarning, match="starting fresh"):
        opened = S.open_session(path, lay, prompt)
    assert opened.status == "fresh" and opened.reuse == 0 and opened.feed == prompt
    assert opened.reason
    assert (tmp_path / "s.coli_kv.stale").exists()
    opened.file.close()
    assert S.read_session_file(path, lay).tokens.size == 0


def test_a_prompt_that_diverges_reuses_the_common_prefix(tmp_path):
    path = tmp_path / "s.coli_kv"
    f = S.SessionFile.create(path, layout())
    f.append([1, 2, 3], states(3))
    f.close()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opened = S.open_session(path, layout(), [1, 2, 9, 4])
    assert opened.status == "resumed" and opened.reuse == 2 and opened.feed == [9, 4]
    np.testing.assert_array_equal(opened.states, states(3)[:2])
    opened.file.close()
    assert S.read_session_file(path, layout()).tokens.tolist() == [1, 2]  # the stale tail is gone
    again = S.open_session(path, layout(), [1, 2])  # equal to the stored tokens: the last step is fed again
    assert again.reuse == 0 and again.feed == [1, 2]
    again.file.close()


def test_second_writer_is_refused(tmp_path):
    path = tmp_path / "s.coli_kv"
    first = S.open_session(path, layout(), [1])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(SidecarError, match="in use"):
            S.open_session(path, layout(), [1])
    first.file.close()


def test_sessions_live_in_the_state_dir(tmp_path):
    assert S.session_path("chat-1") == tmp_path / "state" / "sessions" / "chat-1.coli_kv"
    for bad in ("../x", "a/b", "", ".hidden"):
        with pytest.raises(SidecarError):
            S.session_path(bad)


# --- a real model: kill mid-answer, reopen, continue byte-identically --------------------------------------------

RUNNER = r"""
import sys, time
import numpy as np
from colibri_runtime.loader import load_model
from colibri_runtime.session import ModelSession

container, path, mode, total, prompt = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5]
prompt = [int(x) for x in prompt.split(",")]
model = load_model(container)
session = ModelSession(model, path, model.container.fingerprint)
state, feed = session.open(prompt, continue_stored=mode == "resume")
print("OPENED", session.opened.status, session.opened.reuse, len(feed), flush=True)
tokens = list(state.tokens) + list(feed)
start = state.length
logits = model.forward([np.array(feed)], [state])[0]
session.commit(state, start)
while len(tokens) - len(prompt) < total:
    nxt = int(np.argmax(logits[-1]))
    tokens.append(nxt)
    print("TOKEN", nxt, flush=True)
    if mode == "slow":
        time.sleep(0.3)
    start = state.length
    logits = model.forward([np.array([nxt])], [state])[0]
    session.commit(state, start)
print("DONE", ",".join(str(t) for t in tokens[len(prompt):]), flush=True)
"""

PROMPT = "5,17,99,3,250,42,7,7,130,64,12,200"
TOTAL = 14


@pytest.fixture(scope="module")
def dsa_container(tmp_path_factory):
    import tiny_models
    from colibri_convert.convert import convert
    from colibri_convert.sources import open_source

    root = tmp_path_factory.mktemp("session-model")
    checkpoint = tiny_models.save_tiny_checkpoint("glm_moe_dsa", root / "checkpoint", dtype="f32")
    convert(open_source(str(checkpoint), None), root / "container", None, progress=None)
    return root / "container"


def _run(container, path, mode, env):
    import subprocess
    import sys

    return subprocess.Popen(
        [sys.executable, "-c", RUNNER, str(container), str(path), mode, str(TOTAL), PROMPT],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )


def _done(proc) -> tuple[list[str], list[int]]:
    out, _ = proc.communicate(timeout=300)
    lines = out.splitlines()
    assert proc.returncode == 0, out
    return lines, [int(t) for t in lines[-1].split()[1].split(",")]


def test_sigkill_mid_answer_then_resume_is_byte_identical(dsa_container, tmp_path):
    import os
    import signal

    env = dict(os.environ)
    _, uninterrupted = _done(_run(dsa_container, tmp_path / "a.coli_kv", "fast", env))
    assert len(uninterrupted) == TOTAL

    victim = _run(dsa_container, tmp_path / "b.coli_kv", "slow", env)
    seen = []
    for line in victim.stdout:
        if line.startswith("TOKEN"):
            seen.append(int(line.split()[1]))
            if len(seen) == 5:
                os.kill(victim.pid, signal.SIGKILL)
                break
    victim.wait(timeout=60)
    assert victim.returncode == -signal.SIGKILL
    assert seen == uninterrupted[:5]

    lines, resumed = _done(_run(dsa_container, tmp_path / "b.coli_kv", "resume", env))
    _, status, reuse, fed = lines[0].split()
    assert status == "resumed"
    prompt_len = len(PROMPT.split(","))
    assert int(reuse) >= prompt_len + 3 and int(fed) == 1  # the prompt is not prefilled again: one token fed
    assert resumed == uninterrupted


def test_model_session_rejects_other_model_and_restores_gqa(tmp_path):
    """A GQA family's K/V round-trip through the file, and a session of another model starts fresh."""
    import tiny_models
    from colibri_convert.convert import convert
    from colibri_convert.sources import open_source
    from colibri_runtime.loader import load_model

    checkpoint = tiny_models.save_tiny_checkpoint("qwen3_moe", tmp_path / "ckpt", dtype="f32")
    convert(open_source(str(checkpoint), None), tmp_path / "container", None, progress=None)
    model = load_model(tmp_path / "container")
    prompt = [3, 9, 27, 81, 243, 1]
    path = tmp_path / "q.coli_kv"

    session = S.ModelSession(model, path, model.container.fingerprint)
    state, feed = session.open(prompt)
    logits = model.forward([np.array(feed)], [state])[0]
    session.commit(state, 0)
    nxt = int(np.argmax(logits[-1]))
    want = model.forward([np.array([nxt])], [state])[0]
    session.close()

    again = S.ModelSession(model, path, model.container.fingerprint)
    restored, feed = again.open(prompt + [nxt])
    assert again.opened.status == "resumed" and feed == [nxt]
    assert np.array_equal(model.forward([np.array(feed)], [restored])[0], want)
    again.close()

    other = S.ModelSession(model, path, "ef" * 32)
    with pytest.warns(S.SessionWarning, match="another model"):
        _, feed = other.open(prompt)
    assert other.opened.status == "fresh" and feed == prompt
    other.close()
