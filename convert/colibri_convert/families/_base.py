"""What every converter family produces: a `ModelPlan` saying which tensors a checkpoint must hold, with their shapes
from config.json and their tensor classes, and which layers hold routed experts under which names.

A family module is small: `MODEL_TYPE` and `plan(config) -> ModelPlan`, built from the helpers here. The converter
matches every source tensor name against the plan; anything the plan does not name is a leftover and fails the
conversion, anything it names but the source lacks is missing and fails it too.

MTP layers (DeepSeek-V3 / GLM-5 `model.layers.{n}.*` for n >= num_hidden_layers): every tensor of an MTP layer goes to
the "mtp" group (their own mtp-NNNNN.safetensors files). Its matrices use the recipe's "mtp" encoding (int8 by
default: int4 MTP heads lose most draft acceptance); its norms, router and biases stay f32. The routed experts of an
MTP layer are stored as expert records of that layer index, so the runtime streams them like any other expert, but
encoded with the "mtp" encoding, never the routed-expert one: the record's per-part encodings say so. A checkpoint
without MTP weights (transformers' save_pretrained drops them) converts without them; a partial MTP layer fails.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from colibri_format.errors import ConversionError

RESIDENT = "resident"
MTP = "mtp"


@dataclass(frozen=True)
class TensorSpec:
    """One resident tensor the checkpoint must hold."""

    shape: tuple[int, ...]
    tensor_class: str
    group: str = RESIDENT


@dataclass(frozen=True)
class ExpertLayer:
    """The routed experts of one layer: per-expert names `{prefix}.{e}.{part}.weight`, fused `{prefix}.gate_up_proj`."""

    layer: int
    prefix: str
    num_experts: int
    part_names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
    tensor_class: str = "routed_experts"
    fused_prefix: str | None = None  # where a fused (transformers in-memory) layout keeps them, when it differs


@dataclass(frozen=True)
class ModelPlan:
    family: str
    tensors: dict[str, TensorSpec]
    expert_layers: dict[int, ExpertLayer]
    expert_shapes: dict[str, tuple[int, int]]  # gate/up: (I, H), down: (H, I)
    mtp_layers: tuple[int, ...] = ()
    aliases: dict[str, str] = field(default_factory=dict)  # source name -> canonical name

    def mtp_prefixes(self) -> tuple[str, ...]:
        return tuple(f"model.layers.{n}." for n in self.mtp_layers)


# --- config access ------------------------------------------------------------------------------------------------


def cfg_get(config: dict, *keys: str, default=None):
    """The first of `keys` present (and not None) in config.json, else `default` (an error when None)."""
    for key in keys:
        if config.get(key) is not None:
            return config[key]
    if default is None:
        raise ConversionError(f"config.json lacks {' / '.join(keys)}; this checkpoint cannot be converted as is")
    return default


def num_experts(config: dict) -> int:
    return int(cfg_get(config, "n_routed_experts", "num_experts", "num_local_experts"))


def head_dim(config: dict) -> int:
    return int(cfg_get(config, "head_dim", default=config["hidden_size"] // config["num_attention_heads"]))


# --- building blocks ----------------------------------------------------------------------------------------------


class PlanBuilder:
    """Accumulates tensor specs; `group`/`matrix_class` switch to MTP handling for MTP layers."""

    def __init__(self, family: str, config: dict):
        self.family = family
        self.config = config
        self.tensors: dict[str, TensorSpec] = {}
        self.expert_layers: dict[int, ExpertLayer] = {}
        self.mtp_layers: list[int] = []
        self.aliases: dict[str, str] = {}
        self.hidden = int(config["hidden_size"])
        self.vocab = int(config["vocab_size"])

    def add(self, name: str, shape, tensor_class: str, *, mtp: bool = False) -> None:
        if mtp:
            tensor_class = tensor_class if tensor_class in ("norm", "bias", "router") else "mtp"
        self.tensors[name] = TensorSpec(tuple(int(d) for d in shape), tensor_class, MTP if mtp else RESIDENT)

    def embeddings_and_head(self) -> None:
        self.add("model.embed_tokens.weight", (self.vocab, self.hidden), "embeddings")
        self.add("model.norm.weight", (self.hidden,), "norm")
        if not self.config.get("tie_word_embeddings", False):
            self.add("lm_head.weight", (self.vocab, self.hidden), "lm_head")

    def layer_norms(self, p: str, *, mtp: bool = False) -> None:
        self.add(p + "input_layernorm.weight", (self.hidden,), "norm", mtp=mtp)
        self.add(p + "post_attention_layernorm.weight", (self.hidden,), "norm", mtp=mtp)

    def gqa_attention(self, p: str, *, q_bias: bool, k_bias: bool, v_bias: bool, o_bias: bool,
                      qk_norm: str | None, mtp: bool = False) -> None:
        """Grouped-query attention; qk_norm: None, "head" (per head_dim) or "full" (OLMoE: over all heads)."""
        c = self.config
        hd = head_dim(c)
        q_out, kv_out = c["num_attention_heads"] * hd, c["num_key_value_heads"] * hd
        for name, rows, cols, bias in (("q_proj", q_out, self.hidden, q_bias), ("k_proj", kv_out, self.hidden, k_bias),
                                       ("v_proj", kv_out, self.hidden, v_bias), ("o_proj", self.hidden, q_out, o_bias)):
            self.add(f"{p}self_attn.{name}.weight", (rows, cols), "attention", mtp=mtp)
            if bias:
                self.add(f"{p}self_attn.{name}.bias", (rows,), "bias", mtp=mtp)
        if qk_norm == "head":
            self.add(p + "self_attn.q_norm.weight", (hd,), "norm", mtp=mtp)
            self.add(p + "self_attn.k_norm.weight", (hd,), "norm", mtp=mtp)
        elif qk_norm == "full":
            self.add(p + "self_attn.q_norm.weight", (q_out,), "norm", mtp=mtp)
            self.add(p + "self_attn.k_norm.weight", (kv_out,), "norm", mtp=mtp)

    def mla_attention(self, p: str, *, indexer: bool, mtp: bool = False) -> None:
        """Multi-head latent attention (DeepSeek-V3), optionally with GLM-5's DSA lightning indexer."""
        c = self.config
        heads = int(c["num_attention_heads"])
        nope, rope, v = int(c["qk_nope_head_dim"]), int(c["qk_rope_head_dim"]), int(c["v_head_dim"])
        kv_lora, q_lora = int(c["kv_lora_rank"]), c.get("q_lora_rank")
        a = p + "self_attn."
        if q_lora:
            self.add(a + "q_a_proj.weight", (q_lora, self.hidden), "attention", mtp=mtp)
            self.add(a + "q_a_layernorm.weight", (q_lora,), "norm", mtp=mtp)
            self.add(a + "q_b_proj.weight", (heads * (nope + rope), q_lora), "attention", mtp=mtp)
        else:
            self.add(a + "q_proj.weight", (heads * (nope + rope), self.hidden), "attention", mtp=mtp)
        self.add(a + "kv_a_proj_with_mqa.weight", (kv_lora + rope, self.hidden), "attention", mtp=mtp)
        self.add(a + "kv_a_layernorm.weight", (kv_lora,), "norm", mtp=mtp)
        self.add(a + "kv_b_proj.weight", (heads * (nope + v), kv_lora), "attention", mtp=mtp)
        self.add(a + "o_proj.weight", (self.hidden, heads * v), "attention", mtp=mtp)
        if c.get("attention_bias"):
            raise ConversionError(f"{self.family}: MLA with attention_bias=true is not supported")
        if indexer:
            ih, idim = int(c["index_n_heads"]), int(c["index_head_dim"])
            self.add(a + "indexer.wq_b.weight", (ih * idim, int(q_lora)), "attention", mtp=mtp)
            self.add(a + "indexer.wk.weight", (idim, self.hidden), "attention", mtp=mtp)
            self.add(a + "indexer.k_norm.weight", (idim,), "norm", mtp=mtp)
            self.add(a + "indexer.k_norm.bias", (idim,), "bias", mtp=mtp)
            self.add(a + "indexer.weights_proj.weight", (ih, self.hidden), "attention", mtp=mtp)

    def gated_mlp(self, p: str, inter: int, tensor_class: str, *, mtp: bool = False,
                  names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")) -> None:
        g, u, d = names
        self.add(f"{p}{g}.weight", (inter, self.hidden), tensor_class, mtp=mtp)
        self.add(f"{p}{u}.weight", (inter, self.hidden), tensor_class, mtp=mtp)
        self.add(f"{p}{d}.weight", (self.hidden, inter), tensor_class, mtp=mtp)

    def experts(self, layer: int, prefix: str, *, mtp: bool = False, part_names=("gate_proj", "up_proj", "down_proj"),
                fused_prefix: str | None = None) -> None:
        self.expert_layers[layer] = ExpertLayer(layer, prefix, num_experts(self.config), tuple(part_names),
                                                "mtp" if mtp else "routed_experts", fused_prefix)

    def mtp_head(self, n: int) -> None:
        """The MTP-specific tensors of DeepSeek-V3 / GLM-5 layer n (the decoder layer itself is added separately)."""
        p = f"model.layers.{n}."
        self.mtp_layers.append(n)
        self.add(p + "enorm.weight", (self.hidden,), "norm", mtp=True)
        self.add(p + "hnorm.weight", (self.hidden,), "norm", mtp=True)
        self.add(p + "eh_proj.weight", (self.hidden, 2 * self.hidden), "mtp", mtp=True)
        self.add(p + "shared_head.norm.weight", (self.hidden,), "norm", mtp=True)
        self.add(p + "shared_head.head.weight", (self.vocab, self.hidden), "mtp", mtp=True)

    def build(self) -> ModelPlan:
        c = self.config
        inter = int(cfg_get(c, "moe_intermediate_size", "intermediate_size"))
        if self.family == "mixtral":
            inter = int(c["intermediate_size"])
        shapes = {"gate": (inter, self.hidden), "up": (inter, self.hidden), "down": (self.hidden, inter)}
        return ModelPlan(self.family, dict(self.tensors), dict(self.expert_layers), shapes,
                         tuple(self.mtp_layers), dict(self.aliases))


# Optional tensors DeepSeek-V3-style MTP layers may carry (a copy of the embeddings); converted when present.
OPTIONAL_MTP_SUFFIXES = ("embed_tokens.weight",)

_EXPERT_RE = re.compile(r"^(?P<prefix>.+\.experts)\.(?P<expert>\d+)\.(?P<part>[A-Za-z0-9_]+)\.weight$")
_FUSED_RE = re.compile(r"^(?P<prefix>.+\.experts)\.(?P<which>gate_up_proj|down_proj)(?:\.weight)?$")


@dataclass(frozen=True)
class Resident:
    name: str  # canonical (checkpoint) name
    spec: TensorSpec


@dataclass(frozen=True)
class ExpertPart:
    layer: int
    expert: int
    part: str  # gate | up | down
    tensor_class: str


@dataclass(frozen=True)
class FusedExperts:
    layer: int
    which: str  # gate_up | down
    tensor_class: str


def resolve(plan: ModelPlan, name: str) -> Resident | ExpertPart | FusedExperts | None:
    """What a source tensor is, or None if the plan has no place for it (a leftover)."""
    canonical = plan.aliases.get(name, name)
    spec = plan.tensors.get(canonical)
    if spec is not None:
        return Resident(canonical, spec)
    for n in plan.mtp_layers:
        for suffix in OPTIONAL_MTP_SUFFIXES:
            if name == f"model.layers.{n}.{suffix}":
                return Resident(name, TensorSpec((int(plan_vocab(plan)), int(plan.expert_shapes["down"][0])),
                                                 "mtp", MTP))
    m = _EXPERT_RE.match(name)
    if m:
        for el in plan.expert_layers.values():
            if m["prefix"] == el.prefix and m["part"] in el.part_names:
                expert = int(m["expert"])
                if expert >= el.num_experts:
                    return None
                part = ("gate", "up", "down")[el.part_names.index(m["part"])]
                return ExpertPart(el.layer, expert, part, el.tensor_class)
    m = _FUSED_RE.match(name)
    if m:
        for el in plan.expert_layers.values():
            if m["prefix"] in (el.prefix, el.fused_prefix):
                return FusedExperts(el.layer, "gate_up" if m["which"] == "gate_up_proj" else "down", el.tensor_class)
    return None


def plan_vocab(plan: ModelPlan) -> int:
    spec = plan.tensors["model.embed_tokens.weight"]
    return spec.shape[0]
