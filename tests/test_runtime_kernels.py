"""Runtime kernels and shared layers: matmul exactness and determinism, RoPE variants and routers against
transformers' own functions, sampling and the chat template."""

from __future__ import annotations

import json
import math

import numba
import numpy as np
import pytest
from colibri_runtime import kernels
from colibri_runtime.layers import RMSNorm, SigmoidRouter, SoftmaxRouter, causal_attention, compute_inv_freq
from colibri_runtime.sampling import Sampler, SamplingParams, filter_top_p
from colibri_runtime.weights import Linear

from colibri_format.constants import Encoding
from colibri_format.quant import dequantize, quantize


@pytest.fixture(scope="module", autouse=True)
def warm():
    kernels.warm_up()


# --- matmul --------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("encoding", Encoding.ALL)
@pytest.mark.parametrize("width", [64, 150, 200])
def test_linear_matches_dequantized_matmul(encoding, width):
    rng = np.random.default_rng(width)
    w = rng.standard_normal((37, width)).astype(np.float32)
    qt = quantize(w, encoding)
    x = rng.standard_normal((5, width)).astype(np.float32)
    b = rng.standard_normal(37).astype(np.float32)
    ref = x.astype(np.float64) @ dequantize(qt).astype(np.float64).T + b
    got = kernels.linear(x, kernels.prepare_weight(qt), b)
    # float32 accumulation over <= 200 terms of magnitude ~1: a few 1e-6
    assert np.abs(got - ref).max() < 2e-5


@pytest.mark.parametrize("encoding", [Encoding.INT4_GS64, Encoding.INT8_GS64, Encoding.F32])
def test_linear_rows_independent_of_batch_and_threads(encoding):
    rng = np.random.default_rng(7)
    w = rng.standard_normal((53, 130)).astype(np.float32) * 3
    pw = kernels.prepare_weight(quantize(w, encoding))
    x = rng.standard_normal((9, 130)).astype(np.float32)
    full = kernels.linear(x, pw)
    one_by_one = np.concatenate([kernels.linear(x[i:i + 1], pw) for i in range(9)])
    assert np.array_equal(full.view(np.uint32), one_by_one.view(np.uint32))
    assert np.array_equal(kernels.linear(x[2:6], pw), full[2:6])
    threads = numba.get_num_threads()
    try:
        numba.set_num_threads(1)
        single = kernels.linear(x, pw)
        single_row = kernels.linear(x[4:5], pw)
    finally:
        numba.set_num_threads(threads)
    assert np.array_equal(single, full)
    assert np.array_equal(single_row, full[4:5])


def test_int4_nibble_layout_low_is_j_high_is_j_plus_32():
    # A weight with a single non-zero element at column 40 (high nibble of byte 8) must pick x[40] only.
    w = np.zeros((1, 64), np.float32)
    w[0, 40] = -8.0
    w[0, 3] = 0.0
    pw = kernels.prepare_weight(quantize(w, Encoding.INT4_GS64))
    x = np.arange(64, dtype=np.float32)[None]
    assert kernels.linear(x, pw)[0, 0] == np.float32(-8.0 * 40)


def test_linear_rejects_wrong_width():
    from colibri_format.errors import RuntimeModelError

    pw = kernels.prepare_weight(quantize(np.ones((2, 64), np.float32), Encoding.INT8_GS64))
    with pytest.raises(RuntimeModelError):
        kernels.linear(np.ones((1, 63), np.float32), pw)


# --- layers against transformers ----------------------------------------------------------------------------------


def test_rmsnorm_matches_torch():
    torch = pytest.importorskip("torch")
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeRMSNorm

    rng = np.random.default_rng(0)
    x = rng.standard_normal((4, 3, 100)).astype(np.float32)
    w = rng.standard_normal(100).astype(np.float32)
    ref_mod = Qwen3MoeRMSNorm(100, eps=1e-6)
    with torch.no_grad():
        ref_mod.weight.copy_(torch.from_numpy(w))
        ref = ref_mod(torch.from_numpy(x)).numpy()
    got = RMSNorm(w, 1e-6)(x)
    assert np.abs(got - ref).max() < 1e-5


@pytest.mark.parametrize("rope", [
    {"rope_type": "default"},
    {"rope_type": "linear", "factor": 4.0},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 64},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "beta_fast": 32, "beta_slow": 1},
    {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 64, "mscale": 1.0,
     "mscale_all_dim": 1.0},
    {"rope_type": "default", "partial_rotary_factor": 0.5},
])
def test_rope_frequencies_match_transformers(rope):
    pytest.importorskip("torch")
    import transformers
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = dict(rope, rope_theta=10000.0)
    cfg = transformers.LlamaConfig(hidden_size=128, num_attention_heads=2, max_position_embeddings=256,
                                   rope_parameters=params)
    head_dim = 64
    if params["rope_type"] == "default":
        dim = int(head_dim * params.get("partial_rotary_factor", 1.0))
        ref = 1.0 / (10000.0 ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
        ref_scale = 1.0
    else:
        inv, ref_scale = ROPE_INIT_FUNCTIONS[params["rope_type"]](cfg, "cpu")
        ref = inv.numpy()
    got, scale, dim = compute_inv_freq(dict(cfg.rope_parameters), head_dim, 256)
    assert got.shape == ref.shape
    np.testing.assert_allclose(got, ref, rtol=2e-6)
    assert math.isclose(scale, float(ref_scale), rel_tol=1e-6)


def test_softmax_router_matches_transformers():
    torch = pytest.importorskip("torch")
    import transformers
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    cfg = transformers.Qwen3MoeConfig(hidden_size=64, num_experts=8, num_experts_per_tok=3, norm_topk_prob=True)
    ref = Qwen3MoeTopKRouter(cfg)
    rng = np.random.default_rng(1)
    w = rng.standard_normal((8, 64)).astype(np.float32)
    x = rng.standard_normal((6, 64)).astype(np.float32)
    with torch.no_grad():
        ref.weight.copy_(torch.from_numpy(w))
        _, ref_w, ref_i = ref(torch.from_numpy(x))
    router = SoftmaxRouter(Linear(kernels.prepare_dense(w)), 3, True)
    got_w, got_i = router.route(x)
    order = np.argsort(ref_i.numpy(), axis=1)
    assert np.array_equal(np.sort(got_i, axis=1), np.take_along_axis(ref_i.numpy(), order, 1))
    np.testing.assert_allclose(np.take_along_axis(got_w, np.argsort(got_i, 1), 1),
                               np.take_along_axis(ref_w.numpy(), order, 1), atol=1e-6)


def test_sigmoid_group_router_matches_transformers():
    torch = pytest.importorskip("torch")
    import transformers
    from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeTopkRouter

    cfg = transformers.Glm4MoeConfig(hidden_size=64, n_routed_experts=16, num_experts_per_tok=4, n_group=4,
                                     topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True)
    ref = Glm4MoeTopkRouter(cfg)
    rng = np.random.default_rng(2)
    w = rng.standard_normal((16, 64)).astype(np.float32)
    bias = (0.3 * rng.standard_normal(16)).astype(np.float32)
    x = rng.standard_normal((10, 64)).astype(np.float32)
    with torch.no_grad():
        ref.weight.copy_(torch.from_numpy(w))
        ref.e_score_correction_bias.copy_(torch.from_numpy(bias))
        _, ref_w, ref_i = ref(torch.from_numpy(x))
    router = SigmoidRouter(Linear(kernels.prepare_dense(w)), 4, True, bias, 4, 2, 2.5)
    got_w, got_i = router.route(x)
    ri, rw = ref_i.numpy(), ref_w.numpy()
    for r in range(10):
        assert sorted(got_i[r]) == sorted(ri[r])
        np.testing.assert_allclose(got_w[r][np.argsort(got_i[r])], rw[r][np.argsort(ri[r])], atol=1e-6)


def test_causal_attention_matches_naive_softmax():
    rng = np.random.default_rng(3)
    q = rng.standard_normal((5, 4, 16)).astype(np.float32)
    k = rng.standard_normal((9, 2, 16)).astype(np.float32)
    v = rng.standard_normal((9, 2, 8)).astype(np.float32)
    pos = np.arange(4, 9)
    got = causal_attention(q, k, v, pos, 0.25)
    for i, p in enumerate(pos):
        for h in range(4):
            s = (k[: p + 1, h // 2] @ q[i, h]) * 0.25
            e = np.exp(s - s.max())
            np.testing.assert_allclose(got[i, h], (e / e.sum()) @ v[: p + 1, h // 2], atol=1e-5)
    windowed = causal_attention(q, k, v, pos, 0.25, window=3)
    s = (k[6:9, 0] @ q[4, 0]) * 0.25
    e = np.exp(s - s.max())
    np.testing.assert_allclose(windowed[4, 0], (e / e.sum()) @ v[6:9, 0], atol=1e-5)


# --- sampling and chat template ------------------------------------------------------------------------------------


def test_greedy_and_penalty():
    logits = np.array([1.0, 3.0, 2.0, -1.0], np.float32)
    assert Sampler(SamplingParams())(logits) == 1
    # penalty 4 divides the seen positive logit 3 -> 0.75 < 2
    assert Sampler(SamplingParams(repetition_penalty=4.0))(logits, [1]) == 2


def test_top_p_keeps_smallest_set_reaching_p():
    logits = np.log(np.array([0.5, 0.3, 0.15, 0.05], np.float32))
    kept = np.isfinite(filter_top_p(logits, 0.7))
    assert kept.tolist() == [True, True, False, False]


def test_top_k_one_is_greedy_and_seed_reproduces():
    rng = np.random.default_rng(5)
    logits = rng.standard_normal(50).astype(np.float32)
    assert Sampler(SamplingParams(temperature=1.5, top_k=1, seed=3))(logits) == int(np.argmax(logits))
    draws_a = [Sampler(SamplingParams(temperature=1.0, seed=9))(logits) for _ in range(3)]
    s = Sampler(SamplingParams(temperature=1.0, seed=9))
    assert draws_a[0] == draws_a[1] == draws_a[2]
    seq = [s(logits) for _ in range(20)]
    assert len(set(seq)) > 1  # the stream advances


def test_chat_template_renders_in_sandbox(tmp_path):
    import tiny_models
    from colibri_runtime.tokenizer import ChatTokenizer

    tiny_models.build_tokenizer().save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(tiny_models.tokenizer_config()))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 257}))
    tok = ChatTokenizer(tmp_path, {})
    text = tok.render_chat([{"role": "user", "content": "hi"}])
    assert text == "<|bos|><|user|>hi<|assistant|>"
    assert tok.encode_chat([{"role": "user", "content": "hi"}])[0] == 256
    assert tok.eos_ids == [257]
    # chat_template.jinja wins over tokenizer_config.json, and the sandbox refuses unsafe access and mutation
    from colibri_format.errors import RuntimeModelError

    for hostile in ("{{ messages.__class__.__mro__ }}", "{{ messages.append(1) }}"):
        (tmp_path / "chat_template.jinja").write_text(hostile)
        with pytest.raises(RuntimeModelError, match="unsafe"):
            ChatTokenizer(tmp_path, {}).render_chat([{"role": "user", "content": "x"}])
