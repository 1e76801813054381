"""Text in and out: the container's tokenizer.json (tokenizers) and the chat template the model ships
(chat_template.jinja, else tokenizer_config.json's chat_template), rendered in jinja2's immutable sandbox."""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

from colibri_format.errors import RuntimeModelError


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
    except (OSError, ValueError) as exc:
        raise RuntimeModelError(f"{path.name} in the container is unreadable: {exc}") from None


def _token_text(tok) -> str | None:
    if isinstance(tok, dict):
        return tok.get("content")
    return tok


def _as_list(x) -> list[int]:
    if x is None:
        return []
    return [int(v) for v in (x if isinstance(x, (list, tuple)) else [x])]


class ChatTokenizer:
    """Encode/decode, special tokens, end-of-sequence ids and the chat template of one model directory."""

    def __init__(self, directory: str | Path, config: dict | None = None) -> None:
        from tokenizers import Tokenizer

        d = Path(directory)
        path = d / "tokenizer.json"
        if not path.is_file():
            raise RuntimeModelError(f"{d} has no tokenizer.json; colibri-run needs the model's tokenizer.json")
        self._tok = Tokenizer.from_file(str(path))
        self.tokenizer_config = _read_json(d / "tokenizer_config.json")
        self.generation_config = _read_json(d / "generation_config.json")
        self.config = config if config is not None else _read_json(d / "config.json")
        template = None
        if (d / "chat_template.jinja").is_file():
            template = (d / "chat_template.jinja").read_text(encoding="utf-8")
        elif (d / "chat_template.json").is_file():
            template = _read_json(d / "chat_template.json").get("chat_template")
        if template is None:
            template = self.tokenizer_config.get("chat_template")
        if isinstance(template, list):  # named templates: take "default"
            named = {t.get("name"): t.get("template") for t in template}
            template = named.get("default") or next(iter(named.values()), None)
        self.chat_template: str | None = template
        self.bos_token = _token_text(self.tokenizer_config.get("bos_token"))
        self.eos_token = _token_text(self.tokenizer_config.get("eos_token"))

    # --- ids ---------------------------------------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def token_id(self, text: str | None) -> int | None:
        return None if text is None else self._tok.token_to_id(text)

    @property
    def eos_ids(self) -> list[int]:
        """End-of-sequence ids: generation_config's, else config's, plus the tokenizer's eos token."""
        ids = _as_list(self.generation_config.get("eos_token_id")) or _as_list(self.config.get("eos_token_id"))
        eos = self.token_id(self.eos_token)
        if eos is not None and eos not in ids:
            ids.append(eos)
        return ids

    # --- chat --------------------------------------------------------------------------------------------------

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        if not self.chat_template:
            raise RuntimeModelError("this model ships no chat template (chat_template.jinja or tokenizer_config."
                                    "json chat_template); run without --chat")
        from jinja2 import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message):
            raise TemplateError(message)

        def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
            return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
        env.filters["tojson"] = tojson
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        specials = {k: _token_text(v) for k, v in self.tokenizer_config.items()
                    if k.endswith("_token") and isinstance(v, (str, dict))}
        try:
            return env.from_string(self.chat_template).render(
                messages=messages, add_generation_prompt=add_generation_prompt, **specials)
        except TemplateError as exc:
            raise RuntimeModelError(f"the model's chat template failed: {exc}") from None

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        """Rendered template, tokenized without adding special tokens (the template carries them), as transformers
        does."""
        return self.encode(self.render_chat(messages, add_generation_prompt), add_special_tokens=False)
