"""Train colibri-tiny, the default model: a small GLM-5-architecture MoE (`glm_moe_dsa`) with one MTP layer.

Owns: the model shape, the training loop (CPU, deterministic), router balancing, the DSA indexer's training
signal, the MTP layer, evaluation on the held-out split, and the export to a Hugging Face checkpoint in
models/colibri-tiny/ (bf16, per-expert tensor names, MTP layer at `model.layers.{num_hidden_layers}`).

Training recipe, and why:
- Main loss: next-token cross entropy through transformers' GlmMoeDsaForCausalLM (the reference implementation).
- Routing balance, as DeepSeek-V3: after every step each MoE layer's `e_score_correction_bias` moves by
  `gamma * sign(mean_load - load)` per expert (auxiliary-loss-free), plus a small sequence-level balance loss.
- DSA indexer, as DeepSeek-V3.2: transformers runs the indexer without gradients, so it is trained by its own
  loss, the KL divergence from the main attention's head-summed distribution to the indexer's softmax, on
  detached inputs (it never pushes on the main model). The first `--dense-frac` of steps attend densely
  (indexer warm-up), the rest use top-`index_topk` sparse attention, KL restricted to the selected keys.
- MTP, as DeepSeek-V3: at position t, `eh_proj(cat(enorm(embed(x[t+1])), hnorm(h[t])))` -> one full decoder
  layer -> `shared_head.norm` -> the shared output head predicts x[t+2]; h is the main model's final hidden
  state after `model.norm`. Weight 0.3 on its loss. Embedding and output head are shared with the main model
  in training and stored as copies under the MTP layer's names.

The schedule is warmup-stable-decay. With --steps and --decay-start fixed, a run is deterministic. Under a wall
budget (--minutes) the decay starts when 80% of the budget is spent and the run is shortened to what fits in the
rest; the log records the effective `--steps/--decay-start`, and rerunning with them reproduces the run exactly.

Usage: nice -n 10 python models/train_default.py --steps 2000 --minutes 30 --threads 2
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import math
import os
import platform
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

HERE = Path(__file__).resolve().parent
BUILD = HERE / "build"
SEED = 1234
BOS_ID, END_ID, PAD_ID = 0, 1, 5

MODEL_SHAPE = dict(
    hidden_size=256,
    intermediate_size=768,
    moe_intermediate_size=128,
    num_hidden_layers=5,
    first_k_dense_replace=1,
    num_attention_heads=4,
    num_key_value_heads=4,
    n_routed_experts=24,
    num_experts_per_tok=4,
    n_shared_experts=1,
    n_group=1,
    topk_group=1,
    norm_topk_prob=True,
    routed_scaling_factor=2.5,
    q_lora_rank=128,
    kv_lora_rank=64,
    qk_rope_head_dim=32,
    qk_nope_head_dim=64,
    v_head_dim=64,
    index_topk=128,
    index_n_heads=4,
    index_head_dim=64,
    max_position_embeddings=4096,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
    bos_token_id=BOS_ID,
    eos_token_id=[END_ID, BOS_ID],
    pad_token_id=PAD_ID,
    num_nextn_predict_layers=1,
)

# Tensors kept in float32 in the exported checkpoint (the reference keeps these modules in fp32).
FP32_SUFFIXES = ("mlp.gate.weight", "mlp.gate.e_score_correction_bias", "indexer.weights_proj.weight")


# ---------------------------------------------------------------- data

def file_sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def tokenize_split(corpus: Path, split: str, tokenizer_json: Path) -> np.ndarray:
    """Token ids of a split, documents joined with <|endoftext|>; cached under models/build/tokens."""
    os.environ.setdefault("RAYON_NUM_THREADS", "1")
    from tokenizers import Tokenizer

    src = corpus / f"{split}.jsonl"
    key = hashlib.sha256((file_sha(src) + file_sha(tokenizer_json)).encode()).hexdigest()[:16]
    cache = BUILD / "tokens" / f"{split}-{key}.npy"
    if cache.exists():
        return np.load(cache)
    tokenizer = Tokenizer.from_file(str(tokenizer_json))
    texts = []
    with open(src) as f:
        for line in f:
            text = json.loads(line)["text"]
            texts.append(text if text.startswith("<|endoftext|>") else "<|endoftext|>" + text)
    ids = np.concatenate([np.asarray(e.ids, dtype=np.uint16) for e in tokenizer.encode_batch(texts)])
    cache.parent.mkdir(parents=True, exist_ok=True)
    np.save(cache, ids)
    return ids


def heldout_rows(ids: np.ndarray, seq: int, rows: int) -> torch.Tensor:
    """`rows` chunks spread evenly over the held-out split (neighbouring chunks share documents and domains)."""
    chunks = Batches(ids, seq, 1, SEED).chunks
    picks = np.linspace(0, len(chunks) - 1, num=min(rows, len(chunks))).round().astype(int)
    return torch.from_numpy(chunks[picks].astype(np.int64))


class Batches:
    """Non-overlapping chunks of seq+1 tokens, visited in a seeded permutation, epoch after epoch."""

    def __init__(self, ids: np.ndarray, seq: int, batch: int, seed: int):
        self.chunks = ids[: len(ids) // (seq + 1) * (seq + 1)].reshape(-1, seq + 1)
        self.batch, self.seed = batch, seed

    def get(self, step: int) -> torch.Tensor:
        per_epoch = len(self.chunks) // self.batch
        epoch, i = divmod(step, per_epoch)
        order = np.random.default_rng(self.seed + epoch).permutation(len(self.chunks))
        rows = order[i * self.batch : (i + 1) * self.batch]
        return torch.from_numpy(self.chunks[rows].astype(np.int64))

    @property
    def epoch_tokens(self) -> int:
        return self.chunks.size


# ---------------------------------------------------------------- model

def build_config(vocab_size: int):
    from transformers import GlmMoeDsaConfig

    config = GlmMoeDsaConfig(vocab_size=vocab_size, **MODEL_SHAPE)
    config._attn_implementation = "eager"  # the indexer loss needs the attention probabilities
    return config


class MTPLayer(nn.Module):
    """DeepSeek-V3-style multi-token-prediction layer on top of GlmMoeDsaForCausalLM."""

    def __init__(self, config):
        super().__init__()
        from transformers.models.glm_moe_dsa.modeling_glm_moe_dsa import (
            GlmMoeDsaDecoderLayer,
            GlmMoeDsaRMSNorm,
        )

        n = config.num_hidden_layers
        block_config = copy.deepcopy(config)
        block_config.num_hidden_layers = n + 1
        block_config.mlp_layer_types = [*config.mlp_layer_types, "sparse"]
        block_config.indexer_types = [*config.indexer_types, "full"]
        block_config.layer_types = [*config.layer_types, config.layer_types[-1]]
        hidden = config.hidden_size
        self.enorm = GlmMoeDsaRMSNorm(hidden, config.rms_norm_eps)
        self.hnorm = GlmMoeDsaRMSNorm(hidden, config.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * hidden, hidden, bias=False)
        self.block = GlmMoeDsaDecoderLayer(block_config, n)
        self.shared_head_norm = GlmMoeDsaRMSNorm(hidden, config.rms_norm_eps)

    def forward(self, model, input_ids_next: torch.Tensor, hidden: torch.Tensor, stride: int = 1) -> torch.Tensor:
        """input_ids_next: tokens t+1 [B, S]; hidden: main final hidden states at t [B, S, H] -> logits for t+2
        at every `stride`-th position (training computes the output head on a subset to save time)."""
        from transformers.masking_utils import create_causal_mask

        z = self.eh_proj(torch.cat([self.enorm(model.model.embed_tokens(input_ids_next)), self.hnorm(hidden)], -1))
        positions = torch.arange(z.shape[1]).unsqueeze(0)
        position_embeddings = model.model.rotary_emb(z, position_ids=positions)
        mask = create_causal_mask(config=model.config, inputs_embeds=z, attention_mask=None, cache=None,
                                  position_ids=positions, allow_is_causal_skip=False)
        z, _ = self.block(z, attention_mask=mask, position_ids=positions, position_embeddings=position_embeddings)
        return model.lm_head(self.shared_head_norm(z[:, ::stride]))


def mtp_state_dict(mtp: MTPLayer, model, n_experts: int) -> dict[str, torch.Tensor]:
    """MTP weights under the official checkpoint names, experts split per expert like the main layers."""
    p = f"model.layers.{model.config.num_hidden_layers}."
    out = {
        p + "enorm.weight": mtp.enorm.weight,
        p + "hnorm.weight": mtp.hnorm.weight,
        p + "eh_proj.weight": mtp.eh_proj.weight,
        p + "shared_head.norm.weight": mtp.shared_head_norm.weight,
        p + "shared_head.head.weight": model.lm_head.weight,
    }
    for name, tensor in mtp.block.state_dict().items():
        if name == "mlp.experts.gate_up_proj":
            inter = tensor.shape[1] // 2
            for e in range(n_experts):
                out[f"{p}mlp.experts.{e}.gate_proj.weight"] = tensor[e, :inter]
                out[f"{p}mlp.experts.{e}.up_proj.weight"] = tensor[e, inter:]
        elif name == "mlp.experts.down_proj":
            for e in range(n_experts):
                out[f"{p}mlp.experts.{e}.down_proj.weight"] = tensor[e]
        else:
            out[p + name] = tensor
    return {k: v.detach().clone().contiguous() for k, v in out.items()}


# ---------------------------------------------------------------- instrumentation

@dataclass
class Capture:
    """What one forward pass exposes: router outputs, the indexer's scores (with gradients) and attention."""

    routers: list  # (router_logits, topk_indices) per MoE layer, main layers then MTP
    indexer_scores: dict  # attention module -> indexer scores [B, S, T], differentiable w.r.t. the indexer only
    attn_probs: dict  # attention module -> attention probabilities [B, heads, S, T]

    def clear(self) -> None:
        self.routers.clear()
        self.indexer_scores.clear()
        self.attn_probs.clear()


def indexer_logits(ix, hidden: torch.Tensor, q_resid: torch.Tensor, position_embeddings) -> torch.Tensor:
    """GlmMoeDsaIndexer's scores [B, S, T] with gradients, computed without the reference's broadcast copies."""
    from transformers.models.glm_moe_dsa.modeling_glm_moe_dsa import apply_rotary_pos_emb_interleave

    b, s, _ = hidden.shape
    cos, sin = position_embeddings
    q = ix.wq_b(q_resid).view(b, s, ix.n_heads, ix.head_dim)
    q_rot, q_pass = torch.split(q, [ix.qk_rope_head_dim, ix.head_dim - ix.qk_rope_head_dim], dim=-1)
    k = ix.k_norm(ix.wk(hidden)).unsqueeze(2)
    k_rot, k_pass = torch.split(k, [ix.qk_rope_head_dim, ix.head_dim - ix.qk_rope_head_dim], dim=-1)
    q_rot, k_rot = apply_rotary_pos_emb_interleave(q_rot, k_rot, cos, sin, unsqueeze_dim=2)
    q = torch.cat([q_rot, q_pass], dim=-1).float()
    k = torch.cat([k_rot, k_pass], dim=-1).squeeze(2).float()
    scores = F.relu(torch.bmm(q.reshape(b, s * ix.n_heads, ix.head_dim), k.transpose(1, 2)) * ix.softmax_scale)
    weights = ix.weights_proj(hidden.float()).float() * (ix.n_heads**-0.5)  # [B, S, H]
    return torch.einsum("bsht,bsh->bst", scores.view(b, s, ix.n_heads, -1), weights)


def training_indexer_forward(cap: Capture, attn):
    """Replaces an indexer's forward in training: same selection, and keeps its scores for the indexer loss."""

    def forward(hidden_states, q_resid, position_embeddings, attention_mask, position_ids=None, cache=None):
        pe = tuple(t.detach() for t in position_embeddings)
        scores = indexer_logits(attn.indexer, hidden_states.detach(), q_resid.detach(), pe)
        cap.indexer_scores[attn] = scores
        masked = scores.detach()
        if attention_mask.dtype == torch.bool:
            masked = masked.masked_fill(~attention_mask, float("-inf"))
        else:
            masked = masked + attention_mask
        topk = min(attn.indexer.index_topk, masked.shape[-1])
        return masked.topk(topk, dim=-1).indices.to(torch.int32)

    return forward


def instrument(model, mtp: MTPLayer) -> tuple[Capture, list, list]:
    from transformers.models.glm_moe_dsa.modeling_glm_moe_dsa import GlmMoeDsaAttention, GlmMoeDsaTopkRouter

    cap = Capture([], {}, {})
    gates, attns = [], []
    for module in [*model.modules(), *mtp.modules()]:
        if isinstance(module, GlmMoeDsaTopkRouter):
            gates.append(module)
            module.register_forward_hook(lambda m, a, out: cap.routers.append((out[0], out[2])))
        elif isinstance(module, GlmMoeDsaAttention):
            attns.append(module)
            module.register_forward_hook(lambda m, a, out: cap.attn_probs.__setitem__(m, out[1].detach()))
    return cap, gates, attns


def use_training_indexers(cap: Capture, attns: list, on: bool) -> None:
    """Training uses the fast differentiable indexer; evaluation uses the reference forward."""
    for attn in attns:
        if on:
            attn.indexer.forward = training_indexer_forward(cap, attn)
        else:
            attn.indexer.__dict__.pop("forward", None)


def indexer_loss(cap: Capture, attns: list) -> torch.Tensor:
    """KL(attention || indexer) over the keys the attention actually used, averaged over layers and queries."""
    total = torch.zeros(())
    for attn in attns:
        target = cap.attn_probs[attn].float().sum(1)
        target = target / target.sum(-1, keepdim=True)
        support = target > 0
        logq = torch.log_softmax(cap.indexer_scores[attn].masked_fill(~support, -1e30), -1)
        kl = torch.where(support, target * (torch.log(target.clamp_min(1e-30)) - logq), 0.0).sum(-1)
        total = total + kl.mean()
    return total / len(attns)


def balance_loss(cap: Capture, batch: int, n_experts: int, top_k: int) -> torch.Tensor:
    """DeepSeek-V3's sequence-wise balance loss, averaged over MoE layers."""
    total = torch.zeros(())
    for logits, topk in cap.routers:
        scores = logits.sigmoid()
        probs = (scores / scores.sum(-1, keepdim=True)).view(batch, -1, n_experts)
        seq = probs.shape[1]
        counts = F.one_hot(topk.long(), n_experts).sum(1).view(batch, seq, n_experts).sum(1).float()
        f = counts * n_experts / (top_k * seq)
        total = total + (f * probs.mean(1)).sum(-1).mean()
    return total / len(cap.routers)


def expert_counts(cap: Capture, n_experts: int) -> list[torch.Tensor]:
    return [torch.bincount(topk.flatten().long(), minlength=n_experts) for _, topk in cap.routers]


def set_sparse(attns: list, topk: int) -> None:
    for attn in attns:
        attn.indexer.index_topk = topk


# ---------------------------------------------------------------- training

def forward(model, mtp, tokens: torch.Tensor, mtp_stride: int = 1):
    x, y = tokens[:, :-1], tokens[:, 1:]
    hidden = model.model(input_ids=x, use_cache=False).last_hidden_state
    logits = model.lm_head(hidden)
    mtp_logits = mtp(model, x[:, 1:], hidden[:, :-1], mtp_stride)
    loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
    mtp_loss = F.cross_entropy(mtp_logits.flatten(0, 1), y[:, 1:][:, ::mtp_stride].flatten())
    return loss, mtp_loss, logits, mtp_logits


def load_stats(counts: list[torch.Tensor], top_k: int) -> list[dict]:
    stats = []
    for layer_counts in counts:
        share = layer_counts.double() / layer_counts.sum()
        stats.append({
            "min_share": round(float(share.min()), 5),
            "max_share": round(float(share.max()), 5),
            "cv": round(float(share.std(unbiased=False) / share.mean()), 4),
            "max_over_mean": round(float(share.max() / share.mean()), 3),
            "share": [round(float(s), 5) for s in share],
        })
    return stats


@torch.no_grad()
def evaluate(model, mtp, cap, attns, heldout: torch.Tensor, batch: int, n_experts: int, top_k: int) -> dict:
    model.eval()
    mtp.eval()
    use_training_indexers(cap, attns, False)
    set_sparse(attns, model.config.index_topk)
    losses, mtp_losses, accept, mtp_hit, n = 0.0, 0.0, 0, 0, 0
    counts = None
    for i in range(0, len(heldout), batch):
        cap.clear()
        tokens = heldout[i : i + batch]
        loss, mtp_loss, logits, mtp_logits = forward(model, mtp, tokens)
        rows = len(tokens)
        losses += float(loss) * rows
        mtp_losses += float(mtp_loss) * rows
        main_next = logits.argmax(-1)[:, 1:]  # main model's guess for x[t+2], having seen x[t+1]
        draft = mtp_logits.argmax(-1)  # MTP's guess for x[t+2] from h[t] and x[t+1]
        accept += int((draft == main_next).sum())
        mtp_hit += int((draft == tokens[:, 2:]).sum())
        n += draft.numel()
        layer_counts = expert_counts(cap, n_experts)
        counts = layer_counts if counts is None else [a + b for a, b in zip(counts, layer_counts)]
    model.train()
    mtp.train()
    use_training_indexers(cap, attns, True)
    rows = len(heldout)
    layers = [*range(model.config.first_k_dense_replace, model.config.num_hidden_layers), "mtp"]
    return {
        "heldout_loss": round(losses / rows, 4),
        "heldout_ppl": round(math.exp(losses / rows), 2),
        "mtp_heldout_loss": round(mtp_losses / rows, 4),
        "mtp_acceptance_proxy": round(accept / n, 4),
        "mtp_top1_accuracy": round(mtp_hit / n, 4),
        "heldout_tokens": int(heldout[:, :-1].numel()),
        "expert_load": dict(zip(map(str, layers), load_stats(counts, top_k))),
    }


def lr_at(step: int, lr: float, warmup: int, decay_start: int, total: int) -> float:
    """Warmup-stable-decay: linear warm-up, constant, then linear decay to lr/10 over [decay_start, total)."""
    if step < warmup:
        return lr * (step + 1) / warmup
    if step < decay_start:
        return lr
    return lr * (1.0 - 0.9 * (step - decay_start) / max(1, total - decay_start))


def export(model, mtp, out: Path, log: dict) -> None:
    """Writes a Hugging Face checkpoint folder atomically (built beside `out`, then renamed)."""
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    config = json.loads((tmp / "config.json").read_text())
    config["dtype"] = "bfloat16"  # what model.safetensors holds (save_pretrained records the in-memory float32)
    (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    tensors = load_file(tmp / "model.safetensors")
    inter = model.config.moe_intermediate_size
    first_moe = model.config.first_k_dense_replace
    fused = model.model.layers[first_moe].mlp.experts.gate_up_proj.detach()
    assert torch.equal(tensors[f"model.layers.{first_moe}.mlp.experts.1.up_proj.weight"], fused[1, inter:])
    tensors.update(mtp_state_dict(mtp, model, model.config.n_routed_experts))
    tensors = {k: (v.float() if k.endswith(FP32_SUFFIXES) else v.to(torch.bfloat16)).contiguous()
               for k, v in sorted(tensors.items())}
    save_file(tensors, tmp / "model.safetensors", metadata={"format": "pt"})
    tok = HERE / "tokenizer"
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(tok / name, tmp / name)
    generation = {"bos_token_id": BOS_ID, "eos_token_id": [END_ID, BOS_ID], "pad_token_id": PAD_ID,
                  "do_sample": True, "temperature": 0.6, "top_p": 0.9, "repetition_penalty": 1.1,
                  "max_new_tokens": 200}
    (tmp / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    (tmp / "training_log.json").write_text(json.dumps(log, indent=1) + "\n")
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)


def load_checkpoint(path: Path):
    """The exported checkpoint back as (model, MTP layer), for evaluation of exactly what ships."""
    from transformers import GlmMoeDsaForCausalLM

    model = GlmMoeDsaForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    mtp = MTPLayer(model.config)
    tensors = load_file(path / "model.safetensors")
    p = f"model.layers.{model.config.num_hidden_layers}."
    n_experts = model.config.n_routed_experts
    state = {
        "enorm.weight": tensors[p + "enorm.weight"],
        "hnorm.weight": tensors[p + "hnorm.weight"],
        "eh_proj.weight": tensors[p + "eh_proj.weight"],
        "shared_head_norm.weight": tensors[p + "shared_head.norm.weight"],
    }
    for name in mtp.block.state_dict():
        if name == "mlp.experts.gate_up_proj":
            state["block." + name] = torch.stack([torch.cat([tensors[f"{p}mlp.experts.{e}.gate_proj.weight"],
                                                             tensors[f"{p}mlp.experts.{e}.up_proj.weight"]])
                                                  for e in range(n_experts)])
        elif name == "mlp.experts.down_proj":
            state["block." + name] = torch.stack([tensors[f"{p}mlp.experts.{e}.down_proj.weight"]
                                                  for e in range(n_experts)])
        else:
            state["block." + name] = tensors[p + name]
    mtp.load_state_dict({k: v.float() for k, v in state.items()}, strict=True)
    assert torch.equal(tensors[p + "shared_head.head.weight"].float(), model.lm_head.weight)
    return model, mtp


def evaluate_checkpoint(path: Path, heldout: torch.Tensor, batch: int) -> None:
    """Re-evaluates an exported checkpoint (bf16 weights as shipped) and records it in its training log."""
    model, mtp = load_checkpoint(path)
    cap, _, attns = instrument(model, mtp)
    config = model.config
    result = evaluate(model, mtp, cap, attns, heldout, batch, config.n_routed_experts, config.num_experts_per_tok)
    log_path = path / "training_log.json"
    log = json.loads(log_path.read_text())
    log["final_eval"] = {**result, "weights": "exported checkpoint (bf16)", "rows": "evenly spaced"}
    log_path.write_text(json.dumps(log, indent=1) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "expert_load"}), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2000, help="schedule length (fixes the run)")
    parser.add_argument("--decay-start", type=int, default=None, help="default: 80%% of --steps")
    parser.add_argument("--minutes", type=float, default=30.0, help="hard wall budget")
    parser.add_argument("--threads", type=int, default=1, help="one thread is fastest on a busy machine")
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--warmup", type=int, default=30)
    parser.add_argument("--weight-decay", type=float, default=0.1)
    parser.add_argument("--mtp-weight", type=float, default=0.3)
    parser.add_argument("--mtp-stride", type=int, default=4, help="MTP loss on every n-th position")
    parser.add_argument("--balance-alpha", type=float, default=1e-3, help="sequence-wise balance loss weight")
    parser.add_argument("--bias-gamma", type=float, default=3e-3, help="aux-loss-free bias update speed")
    parser.add_argument("--dense-steps", type=int, default=60, help="indexer warm-up with dense attention")
    parser.add_argument("--eval-rows", type=int, default=128, help="held-out sequences for the final evaluation")
    parser.add_argument("--checkpoint-minutes", type=float, default=6.0)
    parser.add_argument("--corpus", type=Path, default=BUILD / "corpus")
    parser.add_argument("--out", type=Path, default=HERE / "colibri-tiny")
    parser.add_argument("--evaluate-only", action="store_true", help="re-evaluate the checkpoint in --out")
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    torch.manual_seed(SEED)
    np.random.seed(SEED)
    torch.use_deterministic_algorithms(True, warn_only=True)
    import transformers
    from transformers import GlmMoeDsaForCausalLM

    tokenizer_json = HERE / "tokenizer" / "tokenizer.json"
    vocab = json.loads(tokenizer_json.read_text())
    vocab_size = len(vocab["model"]["vocab"])
    t0 = time.time()
    train_ids = tokenize_split(args.corpus, "train", tokenizer_json)
    held_ids = tokenize_split(args.corpus, "heldout", tokenizer_json)
    batches = Batches(train_ids, args.seq, args.batch, SEED)
    heldout = heldout_rows(held_ids, args.seq, args.eval_rows)
    print(f"tokens: train {len(train_ids):,} heldout {len(held_ids):,} ({time.time() - t0:.0f}s)", flush=True)
    if args.evaluate_only:
        evaluate_checkpoint(args.out, heldout, args.batch)
        return

    config = build_config(vocab_size)
    model = GlmMoeDsaForCausalLM(config)
    mtp = MTPLayer(model.config)
    for module in mtp.modules():
        model._init_weights(module)
    cap, gates, attns = instrument(model, mtp)
    use_training_indexers(cap, attns, True)
    n_experts, top_k = config.n_routed_experts, config.num_experts_per_tok
    params = {**dict(model.named_parameters()), **{"mtp." + k: v for k, v in mtp.named_parameters()}}
    n_params = sum(p.numel() for p in params.values())
    print(f"parameters: {n_params:,} (of which MTP {sum(p.numel() for p in mtp.parameters()):,})", flush=True)
    decay = [p for p in params.values() if p.ndim >= 2]
    no_decay = [p for p in params.values() if p.ndim < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                                   {"params": no_decay, "weight_decay": 0.0}],
                                  lr=args.lr, betas=(0.9, 0.95), eps=1e-8)

    dense_steps = args.dense_steps
    total = args.steps
    decay_start = args.decay_start if args.decay_start is not None else int(0.8 * total)
    budget = args.minutes * 60
    log = {
        "model": "colibri-tiny",
        "architecture": "GlmMoeDsaForCausalLM + 1 MTP layer",
        "parameters": n_params,
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "corpus_manifest": json.loads((args.corpus / "manifest.json").read_text()),
        "tokenizer_sha256": file_sha(tokenizer_json),
        "train_tokens_per_epoch": batches.epoch_tokens,
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                     "python": platform.python_version()},
        "machine": f"{platform.machine()} {os.cpu_count()} cpus, {args.threads} threads",
        "curve": [],
    }
    start = time.time()
    deadline = start + args.minutes * 60
    next_checkpoint = start + args.checkpoint_minutes * 60
    window = {"loss": 0.0, "mtp": 0.0, "bal": 0.0, "idx": 0.0, "n": 0}
    stop_reason = "steps"
    step = 0
    set_sparse(attns, args.seq)
    while step < total:
        elapsed = time.time() - start
        if time.time() > deadline:
            stop_reason = "wall budget"
            break
        if step < decay_start and step > 0 and elapsed > 0.8 * budget:
            decay_start = step
            total = min(total, step + max(1, int(0.85 * (budget - elapsed) / (elapsed / step))))
            print(f"wall budget: decay from step {decay_start} to {total}", flush=True)
        if step == dense_steps:
            set_sparse(attns, config.index_topk)
        lr = lr_at(step, args.lr, args.warmup, decay_start, total)
        for group in optimizer.param_groups:
            group["lr"] = lr
        tokens = batches.get(step)
        cap.clear()
        loss, mtp_loss, _, _ = forward(model, mtp, tokens, args.mtp_stride)
        bal = balance_loss(cap, len(tokens), n_experts, top_k)
        idx = indexer_loss(cap, attns)
        objective = loss + args.mtp_weight * mtp_loss + args.balance_alpha * bal + idx
        optimizer.zero_grad(set_to_none=True)
        objective.backward()
        torch.nn.utils.clip_grad_norm_(list(params.values()), 1.0)
        optimizer.step()
        with torch.no_grad():
            for gate, counts in zip(gates, expert_counts(cap, n_experts)):
                load = counts.float()
                gate.e_score_correction_bias += args.bias_gamma * torch.sign(load.mean() - load)
        window["loss"] += loss.item()
        window["mtp"] += mtp_loss.item()
        window["bal"] += bal.item()
        window["idx"] += idx.item()
        window["n"] += 1
        if (step + 1) % 25 == 0 or step == 0:
            n = window.pop("n")
            point = {"step": step + 1, "tokens": (step + 1) * args.batch * args.seq, "lr": round(lr, 6),
                     "seconds": round(time.time() - start, 1), **{k: round(v / n, 4) for k, v in window.items()}}
            log["curve"].append(point)
            window = {"loss": 0.0, "mtp": 0.0, "bal": 0.0, "idx": 0.0, "n": 0}
            print(json.dumps(point), flush=True)
        if time.time() > next_checkpoint:
            next_checkpoint += args.checkpoint_minutes * 60
            log.update(steps=step + 1, stop_reason="intermediate", wall_seconds=round(time.time() - start, 1))
            export(model, mtp, BUILD / "checkpoint", log)
        step += 1
    train_seconds = time.time() - start
    result = evaluate(model, mtp, cap, attns, heldout, args.batch, n_experts, top_k)
    result.update(weights="in-memory float32", rows="evenly spaced")
    log.update(steps=step, stop_reason=stop_reason, reproduce=f"--steps {total} --decay-start {decay_start}",
               wall_seconds=round(train_seconds, 1),
               tokens_seen=step * args.batch * args.seq, final_eval=result,
               correction_bias_range={str(i): [round(float(g.e_score_correction_bias.min()), 4),
                                               round(float(g.e_score_correction_bias.max()), 4)]
                                      for i, g in enumerate(gates)})
    export(model, mtp, args.out, log)
    summary = {k: v for k, v in result.items() if k != "expert_load"}
    summary["load"] = {k: (v["min_share"], v["max_share"], v["cv"]) for k, v in result["expert_load"].items()}
    print(json.dumps({"steps": step, "stop": stop_reason, "seconds": round(train_seconds), **summary}), flush=True)


if __name__ == "__main__":
    main()
