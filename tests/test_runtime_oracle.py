"""Oracle tests of colibri-run: every family's runtime against transformers running the same quantized weights.

Tolerance. Runtime and oracle compute the same float32 function with the same (dequantized) weights; they differ
only in summation order (our kernels: 32 lanes per 64-wide group plus a fixed tree; torch: its own blocking) and in
libm ULPs of exp/cos/rsqrt. A float32 reduction over K terms is off by ~sqrt(K) * 2^-24 relative typically (K * 2^-24
at worst); with K <= 128, a handful of such steps per layer and 2-3 layers, the logits differ by a few 1e-7 relative
to their largest magnitude (measured 3e-7 .. 5e-7 on every family, logits of magnitude ~0.7). LOGIT_TOL_REL = 2e-5
of the largest reference logit leaves a ~40x margin for that noise, while a real defect (one wrong nibble, scale,
bias, norm weight or rotary pair) moves logits by 1e-3 relative or more.
Argmax must agree at every position unless the oracle's own top-2 margin is below NEAR_TIE (1e-4), where such
noise may legitimately flip it.
"""

from __future__ import annotations

import numpy as np
import pytest
import runtime_oracle
from colibri_runtime.generate import Generator, greedy_tokens
from colibri_runtime.loader import load_model
from colibri_runtime.sampling import SamplingParams

from colibri_format.errors import RuntimeModelError

FAMILIES = ("olmoe", "qwen2_moe", "qwen3_moe", "mixtral", "glm4_moe")
LOGIT_TOL_REL = 2e-5
NEAR_TIE = 1e-4
POSITIONS = 32
VOCAB = 320


@pytest.fixture(scope="session")
def warm_kernels():
    from colibri_runtime.kernels import warm_up

    warm_up()


@pytest.fixture(scope="module", params=FAMILIES)
def pair(request, tmp_path_factory, warm_kernels):
    return runtime_oracle.build_pair(request.param, tmp_path_factory.mktemp(request.param))


def prompt(seed: int, n: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n)


def test_teacher_forced_logits_match_transformers(pair):
    ids = prompt(1, POSITIONS)
    ref = runtime_oracle.reference_logits(pair.reference, ids)
    model = load_model(pair.container)
    got = model.prefill(ids, model.new_state(), all_logits=True)
    assert got.shape == ref.shape == (POSITIONS, VOCAB)
    diff = float(np.abs(got - ref).max())
    tol = LOGIT_TOL_REL * float(np.abs(ref).max())
    assert diff < tol, f"{pair.family}: max |logit diff| {diff:.2e} >= {tol:.2e}"
    top2 = np.sort(ref, axis=1)[:, -2:]
    margin = top2[:, 1] - top2[:, 0]
    mismatch = got.argmax(1) != ref.argmax(1)
    assert not np.any(mismatch & (margin >= NEAR_TIE)), f"{pair.family}: argmax differs at {np.nonzero(mismatch)}"


def test_greedy_tokens_match_transformers(pair):
    p = prompt(2, 8)
    expected = runtime_oracle.reference_greedy(pair.reference, p, 20)
    model = load_model(pair.container)
    assert greedy_tokens(model, p, 20) == expected


def test_chunked_prefill_is_bitwise_equal(pair):
    ids = prompt(3, 29)
    model = load_model(pair.container)
    whole = model.prefill(ids, model.new_state(), chunk_size=64, all_logits=True)
    for chunk in (1, 5, 16):
        state = model.new_state()
        parts = model.prefill(ids, state, chunk_size=chunk, all_logits=True)
        assert np.array_equal(parts.view(np.uint32), whole.view(np.uint32)), f"chunk {chunk}"
        # and decoding goes on identically
        nxt = model.forward([[7]], [state])[0]
        ref_state = model.new_state()
        model.prefill(ids, ref_state, chunk_size=64)
        assert np.array_equal(nxt, model.forward([[7]], [ref_state])[0])


def test_batch_equals_each_prompt_alone(pair):
    model = load_model(pair.container)
    prompts = [prompt(10 + i, n) for i, n in enumerate((5, 17, 11))]
    alone = []
    for p in prompts:
        st = model.new_state()
        first = model.forward([p], [st], all_logits=True)[0]
        steps = [model.forward([[t]], [st])[0] for t in (3, 99, 200)]
        alone.append((first, steps))
    states = [model.new_state() for _ in prompts]
    firsts = model.forward(prompts, states, all_logits=True)
    batched_steps = [model.forward([[t]] * 3, states) for t in (3, 99, 200)]
    for i, (first, steps) in enumerate(alone):
        assert np.array_equal(firsts[i], first)
        for k, step in enumerate(steps):
            assert np.array_equal(batched_steps[k][i], step)


def test_expert_counters_track_routing(pair):
    model = load_model(pair.container)
    stats = model.experts.stats
    model.prefill(prompt(4, 6), model.new_state(), chunk_size=1)
    top_k = int(model.config["num_experts_per_tok"])
    moe_layers = sum(1 for layer in model.layers if hasattr(layer.ffn, "router"))
    assert stats.tokens == 6
    # one position per forward: exactly top_k distinct experts per MoE layer per token
    assert stats.loaded == 6 * top_k * moe_layers
    assert stats.bytes_read > 0


def test_sampling_is_reproducible_with_a_seed(pair):
    model = load_model(pair.container)
    gen = Generator(model)
    params = SamplingParams(temperature=0.9, top_k=40, top_p=0.95, seed=1234)
    a = [e.token for e in gen.stream(prompt(5, 6), params, max_tokens=8, stop_ids=())]
    b = [e.token for e in gen.stream(prompt(5, 6), params, max_tokens=8, stop_ids=())]
    assert a == b and len(a) == 8


def test_unknown_family_names_the_supported_ones():
    from colibri_runtime.families import get_family

    with pytest.raises(RuntimeModelError, match="olmoe.*qwen3_moe"):
        get_family("llama_moe_9000")
