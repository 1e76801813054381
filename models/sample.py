"""Chat with a trained checkpoint through the reference implementation (transformers), and check it loads.

Owns: the README's generated samples and a load check of models/colibri-tiny: every tensor of the main model
is consumed by GlmMoeDsaForCausalLM.from_pretrained, and the MTP layer's tensors are the only extra ones.

Usage: python models/sample.py [--model models/colibri-tiny] [--prompt "define harbor"] ...
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from safetensors import safe_open

HERE = Path(__file__).resolve().parent
PROMPTS = ["define harbor", "What does the word melancholy mean?", "What does os.path.join do?", "Who are you?"]


def check_load(model, info: dict, path: Path) -> list[str]:
    """Checks that nothing was missing, that only the MTP layer was left over, and that a per-expert tensor
    landed in the fused parameter; returns the MTP tensor names."""
    mtp_prefix = f"model.layers.{model.config.num_hidden_layers}."
    assert not info["missing_keys"], sorted(info["missing_keys"])[:5]
    assert all(k.startswith(mtp_prefix) for k in info["unexpected_keys"]), sorted(info["unexpected_keys"])[:5]
    layer = model.config.first_k_dense_replace
    inter = model.config.moe_intermediate_size
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        up = f.get_tensor(f"model.layers.{layer}.mlp.experts.1.up_proj.weight").float()
        mtp_names = sorted(k for k in f.keys() if k.startswith(mtp_prefix))  # noqa: SIM118 (safe_open)
    assert torch.equal(model.model.layers[layer].mlp.experts.gate_up_proj[1, inter:].float(), up)
    return mtp_names


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=HERE / "colibri-tiny")
    parser.add_argument("--prompt", action="append", help="user message (repeatable)")
    parser.add_argument("--max-new-tokens", type=int, default=80)
    parser.add_argument("--greedy", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model, info = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32, output_loading_info=True)
    model.eval()
    mtp_names = check_load(model, info, args.model)
    print(f"loaded {type(model).__name__}; MTP tensors beside the main model: {len(mtp_names)}")
    for prompt in args.prompt or PROMPTS:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                            return_tensors="pt", return_dict=True)
        out = model.generate(**ids, max_new_tokens=args.max_new_tokens, do_sample=not args.greedy)
        answer = tokenizer.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True)
        print(f"> {prompt}\n{answer.strip()}\n")


if __name__ == "__main__":
    main()
