"""colibri-run's placement, usage, trace and session options, end to end through the command line."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import runtime_oracle
from typer.testing import CliRunner

from colibri_format.usage import UsageCounts
from colibri_runtime.cli import app
from colibri_runtime.trace import RoutingTrace

PROMPT = "the quick brown fox"


@pytest.fixture(scope="module")
def container(tmp_path_factory):
    from colibri_runtime.kernels import warm_up

    warm_up()
    return runtime_oracle.build_pair("glm_moe_dsa", tmp_path_factory.mktemp("cli-placement")).container


def _generate(container, *extra):
    result = CliRunner().invoke(app, ["generate", "--model", str(container), "--max-tokens", "12", *extra, PROMPT])
    assert result.exit_code == 0, result.output
    return result


def test_placement_options_change_no_token(container):
    reference = _generate(container, "--no-prefetch").stdout
    for extra in (["--ram", "0.3", "--pin", "0", "--direct", "on"], ["--pin", "0.0001", "--io-threads", "1"],
                  ["--direct", "off", "--prefetch"]):
        result = _generate(container, *extra)
        assert result.stdout == reference, extra
        assert "experts:" in result.stderr and "memory budget" in result.stderr


def test_usage_history_is_written_and_a_broken_one_is_ignored(container):
    usage_path = container / ".coli_usage"
    usage_path.unlink(missing_ok=True)
    _generate(container)
    first = UsageCounts.load(usage_path)
    assert first.turns == 1 and first.counts.sum() > 0
    usage_path.write_bytes(b"garbage")
    result = _generate(container)
    assert "warning: ignoring" in result.stderr
    assert UsageCounts.load(usage_path).turns == 1


def test_trace_records_every_routing_decision(container, tmp_path):
    trace_path = tmp_path / "run.trace"
    _generate(container, "--trace", str(trace_path))
    trace = RoutingTrace.load(trace_path)
    assert trace.layers and trace.top_k >= 1
    assert trace.tokens >= len(PROMPT.split())  # prompt positions, then one row per decoded token
    assert (trace.routed >= 0).all() and (trace.routed < trace.num_experts).all()
    assert (trace.predicted[:, 1:] >= 0).any()  # lookahead predictions were recorded for later layers


def _chat(container, session, text):
    return CliRunner().invoke(app, ["chat", "--model", str(container), "--session", session, "--max-tokens", "8"],
                              input=text)


def test_session_survives_a_restart(container):
    straight = _chat(container, "straight", "hello\nand then\n/quit\n")
    assert straight.exit_code == 0, straight.output
    first = _chat(container, "split", "hello\n/quit\n")
    second = _chat(container, "split", "and then\n/quit\n")
    assert first.exit_code == 0 and second.exit_code == 0, second.output
    assert "warning" not in second.stderr  # the stored state was reused, not rebuilt
    answers = lambda out: [line.removeprefix("> ") for line in out.splitlines() if line.strip("> ")]  # noqa: E731
    assert answers(first.stdout) + answers(second.stdout) == answers(straight.stdout)


def test_session_killed_mid_answer_continues_byte_identically(container, tmp_path):
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "-m", "colibri_runtime.cli", "chat", "--model", str(container), "--max-tokens", "24",
           "--session"]
    done = subprocess.run(cmd + ["whole"], input="tell me\n/quit\n", capture_output=True, text=True, env=env,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    proc = subprocess.Popen(cmd + ["killed"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, env=env)
    proc.stdin.write(b"tell me\n")
    proc.stdin.flush()
    got = b""
    deadline = time.time() + 240
    while len(got) < 3 and time.time() < deadline:  # a few tokens into the answer
        got += os.read(proc.stdout.fileno(), 1)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    resumed = subprocess.run(cmd + ["killed"], input="/quit\n", capture_output=True, text=True, env=env,
                             timeout=300)
    assert resumed.returncode == 0, resumed.stderr
    assert "resuming the interrupted answer" in resumed.stderr

    def answer(name):
        sessions = Path(os.environ["COLIBRI_STATE_DIR"]) / "sessions"
        return json.loads((sessions / f"{name}.chat.json").read_text())[-1]["content"]

    assert answer("killed") == answer("whole")
