"""Generation, in three layers: `step` (one forward, logits out), `stream` (tokens and text as they come, with stop
rules) and `generate` (the whole answer and its statistics).

Timing and counters: prefill covers the prompt's forward, decode every forward after it; TTFT is the time from the
call to the first generated token. Expert counters are the provider's, taken as a difference over the call.
"""

from __future__ import annotations

import os
import resource
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np

from colibri_format.errors import RuntimeModelError
from colibri_format.units import human_bytes

from .model import DecoderModel, SequenceState
from .sampling import Sampler, SamplingParams
from .weights import ExpertStats

DEFAULT_PREFILL_CHUNK = 256


def rss_bytes() -> int:
    try:
        import psutil

        return int(psutil.Process(os.getpid()).memory_info().rss)
    except (ImportError, OSError):  # psutil missing or unsupported platform
        return peak_rss_bytes()


def peak_rss_bytes() -> int:
    # ru_maxrss is KiB on Linux.
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    generated_tokens: int = 0
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    ttft_seconds: float = 0.0
    decode_steps: int = 0
    experts: ExpertStats = field(default_factory=ExpertStats)
    peak_rss: int = 0
    finish_reason: str = "length"

    @property
    def prefill_tps(self) -> float:
        return self.prompt_tokens / self.prefill_seconds if self.prefill_seconds > 0 else 0.0

    @property
    def decode_tps(self) -> float:
        return self.decode_steps / self.decode_seconds if self.decode_seconds > 0 else 0.0


@dataclass(frozen=True)
class StreamEvent:
    token: int
    text: str  # newly printable text (may be empty while a multi-byte character or a stop string is pending)


@dataclass
class GenerationResult:
    tokens: list[int]
    text: str
    finish_reason: str  # "eos", "stop", "length"
    stats: GenerationStats


class Generator:
    """Runs one model for one conversation state at a time; `tokenizer` is needed only for text and stop strings."""

    def __init__(self, model: DecoderModel, tokenizer=None, prefill_chunk: int = DEFAULT_PREFILL_CHUNK,
                 after_forward: Callable[[SequenceState, int], None] | None = None) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.prefill_chunk = prefill_chunk
        self.after_forward = after_forward  # called as (state, length before the forward) after every forward
        self.last_stats: GenerationStats | None = None

    # --- layer 1: one forward ----------------------------------------------------------------------------------

    def step(self, state: SequenceState, tokens: Sequence[int]) -> np.ndarray:
        """Feed tokens (a prompt, in chunks, or one generated token); returns the logits of the last one."""
        tokens = np.asarray(tokens, dtype=np.int64).reshape(-1)
        if len(tokens) == 0:
            raise RuntimeModelError("nothing to feed: the prompt is empty")
        logits = None
        for start in range(0, len(tokens), max(1, self.prefill_chunk)):
            before = state.length
            logits = self.model.forward([tokens[start:start + self.prefill_chunk]], [state])[0]
            if self.after_forward is not None:
                self.after_forward(state, before)
        return logits[-1]

    # --- layer 2: stream ---------------------------------------------------------------------------------------

    def stream(self, prompt: Sequence[int], params: SamplingParams | None = None, max_tokens: int = 256,
               state: SequenceState | None = None, stop_ids: Sequence[int] | None = None,
               stop_strings: Sequence[str] = (), stats: GenerationStats | None = None) -> Iterator[StreamEvent]:
        """Yield generated tokens with their printable text. Stops on an end-of-sequence id (not yielded), when
        the text contains a stop string (text up to it is yielded), or after max_tokens. `state` continues a
        conversation: `prompt` then holds only the new tokens. The finish reason is left in `stats`."""
        state = state if state is not None else self.model.new_state()
        stats = stats if stats is not None else GenerationStats()
        stop_ids = set(self.tokenizer.eos_ids if stop_ids is None and self.tokenizer is not None else stop_ids or ())
        sampler = Sampler(params if params is not None else SamplingParams())
        before = self.model.experts.stats.snapshot()
        start = time.perf_counter()
        stats.prompt_tokens = len(prompt)
        stats.finish_reason = "length"
        logits = self.step(state, prompt)
        stats.prefill_seconds = time.perf_counter() - start
        generated: list[int] = []
        emitted = ""
        try:
            while len(generated) < max_tokens:
                token = sampler(logits, state.tokens)
                if len(generated) == 0:
                    stats.ttft_seconds = time.perf_counter() - start
                if token in stop_ids:
                    stats.finish_reason = "eos"
                    break
                generated.append(token)
                stats.generated_tokens = len(generated)
                text, stop_hit = self._visible_text(generated, stop_strings)
                delta = text[len(emitted):]
                emitted = text
                yield StreamEvent(token, delta)
                if stop_hit:
                    stats.finish_reason = "stop"
                    break
                if len(generated) >= max_tokens:
                    break
                t0 = time.perf_counter()
                logits = self.step(state, [token])
                stats.decode_seconds += time.perf_counter() - t0
                stats.decode_steps += 1
        finally:
            stats.experts = self.model.experts.stats.since(before)
            stats.peak_rss = peak_rss_bytes()
            self.last_stats = stats

    def _visible_text(self, generated: list[int], stop_strings: Sequence[str]) -> tuple[str, bool]:
        """Text safe to show: up to a stop string if one occurred; otherwise without a trailing incomplete
        character or a tail that could still become a stop string."""
        if self.tokenizer is None:
            return "", False
        text = self.tokenizer.decode(generated)
        for s in stop_strings:
            at = text.find(s) if s else -1
            if at >= 0:
                return text[:at], True
        cut = len(text)
        while cut > 0 and text[cut - 1] == "\ufffd":
            cut -= 1
        for s in stop_strings:
            for k in range(min(len(s) - 1, cut), 0, -1):
                if text[:cut].endswith(s[:k]):
                    cut -= k
                    break
        return text[:cut], False

    # --- layer 3: whole answers --------------------------------------------------------------------------------

    def generate(self, prompt: Sequence[int], params: SamplingParams | None = None, max_tokens: int = 256,
                 state: SequenceState | None = None, stop_ids: Sequence[int] | None = None,
                 stop_strings: Sequence[str] = ()) -> GenerationResult:
        stats = GenerationStats()
        tokens, text = [], []
        for ev in self.stream(prompt, params, max_tokens, state, stop_ids, stop_strings, stats):
            tokens.append(ev.token)
            text.append(ev.text)
        return GenerationResult(tokens, "".join(text), stats.finish_reason, stats)


def continue_state(model: DecoderModel, state: SequenceState, full_prompt: Sequence[int]
                   ) -> tuple[SequenceState, list[int]]:
    """The state and the tokens still to feed for a conversation whose whole rendered prompt is `full_prompt`:
    the kept state when it is a prefix of the prompt (no re-prefill), else a fresh state and the whole prompt."""
    full = [int(t) for t in full_prompt]
    if state.length <= len(full) and full[: state.length] == state.tokens:
        return state, full[state.length:]
    return model.new_state(), full


def greedy_tokens(model: DecoderModel, prompt: Sequence[int], n: int) -> list[int]:
    """n greedy tokens (no stop rule): the oracle tests' reference loop."""
    gen = Generator(model)
    return [ev.token for ev in gen.stream(prompt, SamplingParams(), max_tokens=n, stop_ids=())]


# --- human units ------------------------------------------------------------------------------------------------


def human_seconds(s: float) -> str:
    if s < 1:
        return f"{s * 1000:.0f} ms"
    if s < 120:
        return f"{s:.2f} s"
    return f"{int(s // 60)} min {s % 60:.0f} s"


def format_stats(stats: GenerationStats) -> str:
    e = stats.experts
    return (f"prefill {stats.prompt_tokens} tok at {stats.prefill_tps:.1f} tok/s | decode {stats.generated_tokens} "
            f"tok at {stats.decode_tps:.2f} tok/s | TTFT {human_seconds(stats.ttft_seconds)} | experts/token "
            f"{e.per_token:.1f} | hit rate {100 * e.hit_rate:.1f}% | read {human_bytes(e.bytes_read)} | peak RSS "
            f"{human_bytes(stats.peak_rss)}")
