"""colibri-convert: every family converts within the quantization bound and exports back to transformers; FP8
sources equal their bf16 values; both expert layouts; leftovers, missing tensors, shape disagreements and unknown
families are refused."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import tiny_models as tm
import torch
from colibri_convert.convert import convert
from colibri_convert.export import export_hf
from colibri_convert.families import plan_for
from colibri_convert.families._base import ExpertPart, FusedExperts, Resident, resolve
from colibri_convert.sources import LocalSource
from safetensors.torch import load_file, save_file

from colibri_format.constants import MANIFEST_NAME, Encoding
from colibri_format.errors import ConversionError
from colibri_format.quant import QuantizedTensor
from colibri_format.reader import Container

LAYOUTS = {"olmoe": "per_expert", "qwen2_moe": "fused", "qwen3_moe": "per_expert", "mixtral": "fused",
           "deepseek_v3": "per_expert", "glm4_moe": "fused", "glm_moe_dsa": "per_expert"}


def assert_within_bound(name: str, qt: QuantizedTensor, x: np.ndarray) -> None:
    """Every element within the error of its group's scale: s/2 (s for int4's one clamped code), plus f16 slack."""
    x = np.asarray(x, dtype=np.float32)
    got = qt.dequantize()
    assert got.shape == x.shape, name
    if qt.encoding in (Encoding.F32,):
        np.testing.assert_array_equal(got, x, err_msg=name)
        return
    if qt.encoding not in Encoding.QUANTIZED:
        np.testing.assert_allclose(got, x, rtol=2**-7, atol=0, err_msg=name)
        return
    rows = x.reshape(-1, x.shape[-1])
    groups = -(-rows.shape[1] // 64)
    s = np.repeat(np.abs(qt.scales.astype(np.float32)), 64, axis=1)[:, : rows.shape[1]]
    padded = np.zeros((rows.shape[0], groups * 64), np.float32)
    padded[:, : rows.shape[1]] = np.abs(rows)
    absmax = padded.reshape(rows.shape[0], groups, 64).max(axis=-1)
    divisor = 8.0 if qt.encoding == Encoding.INT4_GS64 else 127.0
    np.testing.assert_allclose(np.abs(qt.scales.astype(np.float32)), absmax / divisor, rtol=2**-10, atol=1e-12,
                               err_msg=f"{name}: scales")
    clamped = np.abs(rows) > 7.5 * s if qt.encoding == Encoding.INT4_GS64 else np.zeros_like(rows, bool)
    bound = np.where(clamped, s, 0.5 * s) * (1 + 2**-9) + 1e-12
    err = np.abs(got.reshape(rows.shape) - rows)
    bad = err > bound
    assert not bad.any(), f"{name}: {int(bad.sum())} elements beyond the bound, worst {float((err - bound).max())}"


def source_values(family: str, layout: str, dtype: str = "bf16") -> dict[str, np.ndarray]:
    sd = tm.checkpoint_state_dict(family, layout=layout)
    if dtype == "bf16":
        sd = {k: v.to(torch.bfloat16) for k, v in sd.items()}
    return {k: v.float().numpy() for k, v in sd.items()}


def check_container_against_source(container: Path, family: str, values: dict[str, np.ndarray]) -> int:
    """Every source tensor is in the container within its bound; returns the number of checks."""
    plan = plan_for(json.loads((container / "config.json").read_text()))
    checked = 0
    with Container.open(container) as c:
        for name, x in values.items():
            kind = resolve(plan, name)
            if isinstance(kind, Resident):
                assert_within_bound(name, c.tensor(kind.name), x)
            elif isinstance(kind, ExpertPart):
                rec = c.expert(kind.layer, kind.expert)
                assert_within_bound(name, getattr(rec, kind.part), x)
                want = c.manifest["recipe"]["mtp" if kind.tensor_class == "mtp" else "routed_experts"]
                assert getattr(rec, kind.part).encoding == want
            elif isinstance(kind, FusedExperts):
                inter = plan.expert_shapes["gate"][0]
                for e in range(x.shape[0]):
                    rec = c.expert(kind.layer, e)
                    if kind.which == "gate_up":
                        assert_within_bound(f"{name}[{e}].gate", rec.gate, x[e, :inter])
                        assert_within_bound(f"{name}[{e}].up", rec.up, x[e, inter:])
                    else:
                        assert_within_bound(f"{name}[{e}]", rec.down, x[e])
            else:
                raise AssertionError(f"{name} has no place in the plan")
            checked += 1
        assert c.num_records == sum(el.num_experts for el in plan.expert_layers.values())
    return checked


@pytest.mark.parametrize("family", tm.FAMILIES)
def test_family_converts_within_bound_and_exports(family, tmp_path):
    layout = LAYOUTS[family]
    src = tm.save_tiny_checkpoint(family, tmp_path / "src", layout=layout, dtype="bf16", num_shards=2)
    summary = convert(LocalSource(src), tmp_path / "out")
    out = tmp_path / "out"
    assert check_container_against_source(out, family, source_values(family, layout)) > 10
    manifest = json.loads((out / MANIFEST_NAME).read_text())
    assert manifest["family"] == family
    assert set(manifest["extra"]["quantization"]) >= {"attention", "routed_experts", "router", "norm"}
    if family in tm.MTP_FAMILIES:
        n = tm.tiny_config(family).num_hidden_layers
        assert summary.mtp_layers == (n,)
        with Container.open(out) as c:
            assert n in c.expert_layers and c.expert(n, 0).gate.encoding == Encoding.INT8_GS64
            assert f"model.layers.{n}.eh_proj.weight" in c.tensor_names("mtp")
            assert c.tensor(f"model.layers.{n}.shared_head.head.weight").encoding == Encoding.INT8_GS64
            assert c.tensor(f"model.layers.{n - 1}.mlp.gate.e_score_correction_bias").encoding == Encoding.F32
    assert not (out / ".colibri-convert").exists() and not (out / ".colibri-convert.lock").exists()

    # export-hf: transformers loads it, and its weights are exactly the container's dequantized values
    hf = export_hf(out, tmp_path / "hf")
    model = tm.load_reference_model(hf)
    exported = load_file(str(hf / "model.safetensors"))
    sd = model.state_dict()
    with Container.open(out) as c:
        for name in c.tensor_names("resident"):
            want = torch.from_numpy(np.array(c.tensor(name).dequantize()))
            torch.testing.assert_close(exported[name], want, rtol=0, atol=0)
        bias = [k for k in sd if k.endswith("e_score_correction_bias")]
        for k in bias:  # f32 class: bit-exact round trip of the randomised routing bias
            torch.testing.assert_close(sd[k], torch.from_numpy(np.array(c.tensor(k).dequantize())), rtol=0, atol=0)
    if family in tm.MTP_FAMILIES:
        assert any(k.startswith(f"model.layers.{tm.tiny_config(family).num_hidden_layers}.") for k in exported)
    ids = torch.randint(0, tm.VOCAB_SIZE, (1, 33), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = tm.build_tiny_model(family)(ids).logits
        got = model(ids).logits
    assert torch.isfinite(got).all()
    assert float((got - ref).abs().max()) < 0.5 * float(ref.abs().max()) + 0.05


def test_both_expert_layouts_give_identical_data_files(tmp_path):
    for layout in ("per_expert", "fused"):
        src = tm.save_tiny_checkpoint("olmoe", tmp_path / layout, layout=layout, dtype="bf16")
        convert(LocalSource(src), tmp_path / f"out-{layout}")
    a, b = tmp_path / "out-per_expert", tmp_path / "out-fused"
    data = sorted(p.name for p in a.iterdir() if p.suffix in (".colx", ".safetensors", ".arrow"))
    assert data == sorted(p.name for p in b.iterdir() if p.suffix in (".colx", ".safetensors", ".arrow"))
    for name in data:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name


def test_fp8_source_equals_its_bf16_values(tmp_path):
    fp8 = tm.save_tiny_checkpoint("deepseek_v3", tmp_path / "fp8", dtype="fp8")
    ref = tm.save_tiny_checkpoint("deepseek_v3", tmp_path / "ref", dtype="fp8_reference")
    assert any(k.endswith("_scale_inv") for k in load_file(str(fp8 / "model.safetensors")))
    convert(LocalSource(fp8), tmp_path / "a")
    convert(LocalSource(ref), tmp_path / "b")
    a, b = tmp_path / "a", tmp_path / "b"
    data = sorted(p.name for p in a.iterdir() if p.suffix in (".colx", ".safetensors", ".arrow"))
    assert any(n.startswith("experts-") for n in data)
    for name in data:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    assert json.loads((a / MANIFEST_NAME).read_text())["extra"]["source_dtypes"] == ["BF16", "F8_E4M3"]


def test_fp8_weight_and_scale_in_different_shards(tmp_path):
    sd = tm.to_fp8_state_dict(tm.checkpoint_state_dict("deepseek_v3", layout="per_expert"))
    src = tmp_path / "src"
    src.mkdir()
    names = sorted(sd)
    # put every _scale_inv of layer 1 in a shard of its own, before or after its weight
    split = {n for n in names if n.endswith("_scale_inv") and ".layers.1." in n}
    shards = {"model-00001-of-00003.safetensors": [n for n in names if n not in split and ".layers.1." not in n],
              "model-00002-of-00003.safetensors": sorted(split),
              "model-00003-of-00003.safetensors": [n for n in names if ".layers.1." in n and n not in split]}
    weight_map = {}
    for fname, group in shards.items():
        save_file({k: sd[k].contiguous() for k in group}, str(src / fname))
        weight_map.update({k: fname for k in group})
    (src / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    ref = tm.save_tiny_checkpoint("deepseek_v3", tmp_path / "ref", dtype="fp8_reference")
    (src / "config.json").write_bytes((ref / "config.json").read_bytes())
    convert(LocalSource(src), tmp_path / "a")
    values = {k: v.float().numpy() for k, v in tm.fp8_reference_state_dict(
        tm.checkpoint_state_dict("deepseek_v3", layout="per_expert")).items()}
    assert check_container_against_source(tmp_path / "a", "deepseek_v3", values) == len(values)


def test_many_shards_split_experts_across_units(tmp_path):
    one = tm.save_tiny_checkpoint("glm_moe_dsa", tmp_path / "one", num_shards=1)
    many = tm.save_tiny_checkpoint("glm_moe_dsa", tmp_path / "many", num_shards=7)
    convert(LocalSource(one), tmp_path / "a")
    convert(LocalSource(many), tmp_path / "b")
    with Container.open(tmp_path / "a") as a, Container.open(tmp_path / "b") as b:
        assert len(b.files_of_role("experts")) > 1
        assert a.tensor_names() == b.tensor_names()
        for name in a.tensor_names():
            np.testing.assert_array_equal(a.tensor(name).data, b.tensor(name).data)
        for layer in a.expert_layers:
            for e in range(a.num_experts):
                ra, rb = a.expert(layer, e), b.expert(layer, e)
                for part in ("gate", "up", "down"):
                    np.testing.assert_array_equal(getattr(ra, part).data, getattr(rb, part).data)
                    np.testing.assert_array_equal(getattr(ra, part).scales, getattr(rb, part).scales)


def test_recipe_flags_change_encodings(tmp_path):
    src = tm.save_tiny_checkpoint("qwen3_moe", tmp_path / "src")
    convert(LocalSource(src), tmp_path / "out", {"routed_experts": "int8_gs64", "attention": "bf16"})
    with Container.open(tmp_path / "out") as c:
        assert c.manifest["recipe"]["routed_experts"] == "int8_gs64"
        assert c.expert(0, 0).down.encoding == "int8_gs64"
        assert c.tensor("model.layers.0.self_attn.q_proj.weight").encoding == "bf16"
    with pytest.raises(ConversionError, match="must not be quantized"):
        convert(LocalSource(src), tmp_path / "out2", {"norm": "int4_gs64"})


# --- refusals -----------------------------------------------------------------------------------------------------


def test_unknown_family_lists_supported(tmp_path):
    src = tm.save_tiny_checkpoint("olmoe", tmp_path / "src")
    cfg = json.loads((src / "config.json").read_text())
    cfg["model_type"] = "llama4_text"
    (src / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConversionError, match="llama4_text.*deepseek_v3, glm4_moe, glm_moe_dsa, mixtral, olmoe"):
        convert(LocalSource(src), tmp_path / "out")


def _rewrite(src: Path, edit) -> None:
    sd = load_file(str(src / "model.safetensors"))
    edit(sd)
    save_file(sd, str(src / "model.safetensors"))


def test_leftover_tensor_fails_with_its_name(tmp_path):
    src = tm.save_tiny_checkpoint("qwen2_moe", tmp_path / "src")
    _rewrite(src, lambda sd: sd.update({"model.layers.0.mlp.mystery.weight": torch.zeros(4, 4)}))
    with pytest.raises(ConversionError, match="model.layers.0.mlp.mystery.weight"):
        convert(LocalSource(src), tmp_path / "out")
    assert not (tmp_path / "out" / MANIFEST_NAME).exists()


def test_missing_tensor_and_expert_fail_with_names(tmp_path):
    src = tm.save_tiny_checkpoint("qwen3_moe", tmp_path / "src")

    def drop(sd):
        del sd["model.layers.1.self_attn.o_proj.weight"]
        del sd["model.layers.0.mlp.experts.3.up_proj.weight"]

    _rewrite(src, drop)
    with pytest.raises(ConversionError) as info:
        convert(LocalSource(src), tmp_path / "out")
    msg = str(info.value)
    assert "model.layers.1.self_attn.o_proj.weight" in msg and "part.0.3" in msg
    assert not (tmp_path / "out" / MANIFEST_NAME).exists()


def test_partial_mtp_layer_fails_but_absent_mtp_is_fine(tmp_path):
    src = tm.save_tiny_checkpoint("deepseek_v3", tmp_path / "src")
    _rewrite(src, lambda sd: sd.pop("model.layers.3.eh_proj.weight"))
    with pytest.raises(ConversionError, match="model.layers.3.eh_proj.weight"):
        convert(LocalSource(src), tmp_path / "out")
    plain = tm.save_tiny_checkpoint("deepseek_v3", tmp_path / "plain", with_mtp=False)
    summary = convert(LocalSource(plain), tmp_path / "out2")
    assert summary.mtp_layers == ()
    with Container.open(tmp_path / "out2") as c:
        assert c.expert_layers == [1, 2] and not c.tensor_names("mtp")


def test_shape_disagreeing_with_config_fails(tmp_path):
    src = tm.save_tiny_checkpoint("mixtral", tmp_path / "src", layout="per_expert")
    cfg = json.loads((src / "config.json").read_text())
    cfg["intermediate_size"] = 80
    (src / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConversionError, match=r"w1.weight has shape \[64, 64\], config.json implies \[80, 64\]"):
        convert(LocalSource(src), tmp_path / "out")
