"""colibri-run end to end on a converted tiny container: generate streams the greedy completion, stop rules hold,
chat keeps the conversation and answers its commands, errors are one line and a non-zero exit."""

from __future__ import annotations

import numpy as np
import pytest
import runtime_oracle
from colibri_runtime.cli import app
from colibri_runtime.generate import Generator
from colibri_runtime.loader import load_model
from colibri_runtime.sampling import SamplingParams
from colibri_runtime.tokenizer import ChatTokenizer
from typer.testing import CliRunner


@pytest.fixture(scope="module")
def container(tmp_path_factory):
    from colibri_runtime.kernels import warm_up

    warm_up()
    return runtime_oracle.build_pair("qwen3_moe", tmp_path_factory.mktemp("cli")).container


@pytest.fixture(scope="module")
def gen(container):
    model = load_model(container)
    return Generator(model, ChatTokenizer(container, model.config))


def test_generate_streams_the_greedy_completion(container, gen):
    expected = gen.generate(gen.tokenizer.encode("the cat"), SamplingParams(), max_tokens=10)
    result = CliRunner().invoke(app, ["generate", "--model", str(container), "--max-tokens", "10",
                                      "--temperature", "0", "the cat"])
    assert result.exit_code == 0, result.output
    assert result.stdout == expected.text + "\n"
    assert "prefill" in result.stderr and "decode" in result.stderr and "peak RSS" in result.stderr


def test_stop_string_and_eos(gen):
    ids = gen.tokenizer.encode("hello")
    full = gen.generate(ids, SamplingParams(), max_tokens=12, stop_ids=())
    assert full.finish_reason == "length" and len(full.tokens) == 12
    text = full.text
    stop = text[len(text) // 2: len(text) // 2 + 2]
    if stop and text.find(stop) > 0:
        cut = gen.generate(ids, SamplingParams(), max_tokens=12, stop_ids=(), stop_strings=[stop])
        assert cut.finish_reason == "stop"
        assert cut.text == text[: text.find(stop)]
    first = full.tokens[0]
    eos = gen.generate(ids, SamplingParams(), max_tokens=12, stop_ids=[first])
    assert eos.finish_reason == "eos" and eos.tokens == []


def test_chat_session_commands(container):
    result = CliRunner().invoke(app, ["chat", "--model", str(container), "--max-tokens", "4"],
                                input="hello\n/stats\nagain\n/reset\n/quit\n")
    assert result.exit_code == 0, result.output
    assert "[conversation reset]" in result.stderr
    assert result.stderr.count("tok/s") >= 3  # two status lines, /stats, the final totals
    assert "hit" in result.stderr and "RSS" in result.stderr


def test_chat_second_turn_equals_the_whole_conversation_at_once(gen):
    """Turn two, fed on the kept state, gives the same tokens as rendering the whole conversation and generating
    from scratch; a rendering that does not extend the state (the answer re-tokenizes differently) starts over."""
    from colibri_runtime.generate import continue_state

    tok, model = gen.tokenizer, gen.model
    turn1 = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "the answer"}]
    convo = turn1 + [{"role": "user", "content": "more"}]
    full = tok.encode_chat(convo)
    kept = model.new_state()
    model.prefill(tok.encode_chat(turn1, add_generation_prompt=False), kept)
    state, todo = continue_state(model, kept, full)
    assert state is kept and 0 < len(todo) < len(full)
    a2 = gen.generate(todo, SamplingParams(), max_tokens=5, state=state, stop_ids=())
    fresh = gen.generate(full, SamplingParams(), max_tokens=5, stop_ids=())
    assert a2.tokens == fresh.tokens
    other = model.new_state()
    model.prefill(tok.encode_chat([{"role": "user", "content": "bye"}]), other)
    state, todo = continue_state(model, other, full)
    assert state is not other and state.length == 0 and todo == full


def test_missing_container_is_one_line_error(tmp_path):
    result = CliRunner().invoke(app, ["generate", "--model", str(tmp_path / "nope"), "x"])
    assert result.exit_code == 1
    assert result.stderr.startswith("colibri-run: error:") and result.stderr.count("\n") == 1


def test_context_limit_is_enforced(gen):
    from colibri_runtime.layers import ContextLimitError

    model = gen.model
    limit = model.max_positions
    with pytest.raises(ContextLimitError):
        model.forward([np.zeros(limit + 1, dtype=np.int64)], [model.new_state()])
