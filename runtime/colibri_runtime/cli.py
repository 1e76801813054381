"""Command line of colibri_runtime: `colibri-run generate` and `colibri-run chat` on a Colibri container.

Generated text goes to stdout as it is produced; statistics, status lines and errors go to stderr. Errors the
library raises on purpose (ColibriError) end the program with one line and exit status 1.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import warnings
from pathlib import Path
from typing import Optional

import typer

from colibri_format.errors import ColibriError

app = typer.Typer(help="Run Colibri containers: generate text or chat.", no_args_is_help=True,
                  add_completion=False)

EXIT_ERROR = 1


def _fail(exc: BaseException, code: int = EXIT_ERROR) -> None:
    typer.echo(f"colibri-run: error: {exc}", err=True)
    raise typer.Exit(code)


@app.command()
def version() -> None:
    """Print the version."""
    from colibri_format import __version__

    typer.echo(__version__)


MODEL_HELP = "Colibri container directory (default: the small model shipped with Colibri)."


def _placement(ram, pin, prefetch, io_threads, direct, mirror, disk_weights, context):
    from .placement import PlacementOptions

    try:
        weights = tuple(float(w) for w in disk_weights.split(",")) if disk_weights else ()
    except ValueError:
        raise ColibriError(f"--disk-weights {disk_weights!r} must be comma-separated numbers, e.g. 9,3") from None
    return PlacementOptions(ram_gb=ram, pin=pin, prefetch=prefetch, io_threads=io_threads, direct=direct,
                            mirrors=tuple(str(m) for m in mirror), disk_weights=weights, context_tokens=context)


def _params(temperature: float, top_p: float, top_k: int, seed: Optional[int], repetition_penalty: float):
    from .sampling import SamplingParams

    return SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p,
                          repetition_penalty=repetition_penalty, seed=seed)


# Sampling options shared by generate and chat.
TEMPERATURE_OPT = typer.Option(0.0, "--temperature", help="Sampling temperature; 0 is greedy.")
TOP_P_OPT = typer.Option(1.0, "--top-p", help="Nucleus sampling mass (1 = off).")
TOP_K_OPT = typer.Option(0, "--top-k", help="Sample among the k most likely tokens (0 = off).")
SEED_OPT = typer.Option(None, "--seed", help="Random seed for sampling.")
REPETITION_OPT = typer.Option(1.0, "--repetition-penalty", help="1 = off.")

# Placement options shared by generate and chat (specs/CONTAINER.md, "Mirrors"; runtime/colibri_runtime/placement.py).
RAM_OPT = typer.Option(None, "--ram", help="RAM budget in GB for weights, expert cache and state "
                       "(default: available memory less a reserve).")
PIN_OPT = typer.Option("auto", "--pin", help="Pinned hot set: auto, a size in GB, 0, or a .coli_usage file.")
PREFETCH_OPT = typer.Option(True, "--prefetch/--no-prefetch", help="Router-lookahead prefetch of the next layer.")
IO_THREADS_OPT = typer.Option(4, "--io-threads", help="Reader threads loading experts.")
DIRECT_OPT = typer.Option("auto", "--direct", help="O_DIRECT reads: on, off or auto (on when the experts "
                          "do not fit the budget).")
MIRROR_OPT = typer.Option([], "--mirror", help="A mirror of the container's data files on another drive "
                          "(repeatable).")
DISK_WEIGHTS_OPT = typer.Option(None, "--disk-weights", help="Relative read bandwidths of the primary and each "
                                "mirror, e.g. 9,3 (default: equal).")
TRACE_OPT = typer.Option(None, "--trace", help="Record every routing decision to this file.")
CONTEXT_OPT = typer.Option(4096, "--context", help="Tokens of attention state to budget for.")
DSA_OPT = typer.Option(False, "--dsa-select-all", help="GLM-5: make the DSA indexer select every key (dense "
                       "attention).")


@app.command()
def generate(
    prompt: str = typer.Argument(..., help="The prompt text."),
    model: Optional[Path] = typer.Option(None, "--model", "-m", help=MODEL_HELP),
    max_tokens: int = typer.Option(256, "--max-tokens", "-n", help="Most tokens to generate."),
    temperature: float = TEMPERATURE_OPT,
    top_p: float = TOP_P_OPT,
    top_k: int = TOP_K_OPT,
    seed: Optional[int] = SEED_OPT,
    repetition_penalty: float = REPETITION_OPT,
    stop: list[str] = typer.Option([], "--stop", help="Stop when the text contains this string (repeatable)."),
    chat: bool = typer.Option(False, "--chat", help="Wrap the prompt in the model's chat template."),
    stats: bool = typer.Option(True, "--stats/--no-stats", help="Print run statistics to stderr at the end."),
    ram: Optional[float] = RAM_OPT,
    pin: str = PIN_OPT,
    prefetch: bool = PREFETCH_OPT,
    io_threads: int = IO_THREADS_OPT,
    direct: str = DIRECT_OPT,
    mirror: list[Path] = MIRROR_OPT,
    disk_weights: Optional[str] = DISK_WEIGHTS_OPT,
    trace: Optional[Path] = TRACE_OPT,
    context: int = CONTEXT_OPT,
    dsa_select_all: bool = DSA_OPT,
) -> None:
    """Complete PROMPT and stream the completion to stdout."""
    from .runner import Runner

    runner = None
    try:
        params = _params(temperature, top_p, top_k, seed, repetition_penalty)
        options = _placement(ram, pin, prefetch, io_threads, direct, mirror, disk_weights, context)
        with _warnings_as_lines():
            runner = Runner.open(model, options, trace, dsa_select_all)
        tokenizer, gen = runner.tokenizer, runner.generator
        ids = (tokenizer.encode_chat([{"role": "user", "content": prompt}]) if chat
               else tokenizer.encode(prompt))
        try:
            with _warnings_as_lines():
                for ev in gen.stream(ids, params, max_tokens, stop_strings=stop):
                    sys.stdout.write(ev.text)
                    sys.stdout.flush()
        except KeyboardInterrupt:
            typer.echo("\n[interrupted]", err=True)
        sys.stdout.write("\n")
        runner.end_turn()
        if stats and gen.last_stats is not None:
            typer.echo(runner.report(gen.last_stats), err=True)
    except ColibriError as exc:
        _fail(exc)
    finally:
        if runner is not None:
            runner.close()


@contextlib.contextmanager
def _warnings_as_lines():
    """Warnings (a broken usage history, a failing mirror, a session that cannot resume) as one stderr line each."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        try:
            yield
        finally:
            for w in caught:
                typer.echo(f"colibri-run: warning: {w.message}", err=True)


# --- chat -----------------------------------------------------------------------------------------------------------

CHAT_HELP = "Commands: /reset (new conversation), /stats (totals so far), /quit (leave). Ctrl-C stops an answer."


def _status_line(stats) -> str:
    from colibri_format.units import human_bytes

    from .generate import human_seconds, rss_bytes

    e = stats.experts
    return (f"[{stats.decode_tps:.2f} tok/s | TTFT {human_seconds(stats.ttft_seconds)} | hit {100 * e.hit_rate:.0f}% "
            f"| read {human_bytes(e.bytes_read)} | RSS {human_bytes(rss_bytes())}]")


class _Conversation:
    """The messages of a chat, kept beside its session file (NAME.chat.json) when the chat is persistent."""

    def __init__(self, system: Optional[str], session: Optional[str]):
        from .session import session_path

        self.system = system
        self.path = session_path(session).with_suffix(".chat.json") if session else None
        self.messages = self._initial()
        if self.path is not None and self.path.is_file():
            try:
                saved = json.loads(self.path.read_text())
                if isinstance(saved, list) and all(isinstance(m, dict) and "role" in m for m in saved):
                    self.messages = saved
            except (OSError, ValueError):
                warnings.warn(f"{self.path} is unreadable; the conversation starts over", stacklevel=2)

    def _initial(self) -> list[dict]:
        return [] if self.system is None else [{"role": "system", "content": self.system}]

    def reset(self) -> None:
        self.messages = self._initial()
        self.save()

    def save(self) -> None:
        if self.path is None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(json.dumps(self.messages, ensure_ascii=False))
        os.replace(tmp, self.path)

    @property
    def awaiting_answer(self) -> bool:
        return bool(self.messages) and self.messages[-1]["role"] == "user"


@app.command()
def chat(
    model: Optional[Path] = typer.Option(None, "--model", "-m", help=MODEL_HELP),
    max_tokens: int = typer.Option(512, "--max-tokens", "-n", help="Most tokens per answer."),
    temperature: float = TEMPERATURE_OPT,
    top_p: float = TOP_P_OPT,
    top_k: int = TOP_K_OPT,
    seed: Optional[int] = SEED_OPT,
    repetition_penalty: float = REPETITION_OPT,
    system: Optional[str] = typer.Option(None, help="A system message opening the conversation."),
    session: Optional[str] = typer.Option(None, help="Name of a persistent session: the conversation and its "
                                          "attention state are kept across runs."),
    ram: Optional[float] = RAM_OPT,
    pin: str = PIN_OPT,
    prefetch: bool = PREFETCH_OPT,
    io_threads: int = IO_THREADS_OPT,
    direct: str = DIRECT_OPT,
    mirror: list[Path] = MIRROR_OPT,
    disk_weights: Optional[str] = DISK_WEIGHTS_OPT,
    trace: Optional[Path] = TRACE_OPT,
    context: int = CONTEXT_OPT,
    dsa_select_all: bool = DSA_OPT,
) -> None:
    """Interactive multi-turn chat with a status line after each answer."""
    from colibri_format.units import human_bytes

    from .generate import GenerationStats, format_stats
    from .runner import Runner

    runner = None
    try:
        params = _params(temperature, top_p, top_k, seed, repetition_penalty)
        options = _placement(ram, pin, prefetch, io_threads, direct, mirror, disk_weights, context)
        with _warnings_as_lines():
            runner = Runner.open(model, options, trace, dsa_select_all)
            conversation = _Conversation(system, session)
        mdl, tokenizer, gen = runner.model, runner.tokenizer, runner.generator
        source = str(runner.container.manifest.get("source", {}).get("repo") or runner.model_dir)
        typer.echo(f"{Path(source).name} ({mdl.family}, {human_bytes(runner.budget.resident)} resident). "
                   f"{CHAT_HELP}", err=True)
        state, reopen = mdl.new_state(), session is not None
        totals = GenerationStats()
        while True:
            answer_prefix: list[int] = []
            if conversation.awaiting_answer and session is not None:
                typer.echo("[resuming the interrupted answer]", err=True)
            else:
                try:
                    line = input("> ")
                except EOFError:
                    break
                except KeyboardInterrupt:
                    typer.echo("", err=True)
                    continue
                text = line.strip()
                if not text:
                    continue
                if text == "/quit":
                    break
                if text == "/reset":
                    conversation.reset()
                    state, reopen = mdl.new_state(), session is not None
                    typer.echo("[conversation reset]", err=True)
                    continue
                if text == "/stats":
                    typer.echo(runner.report(totals), err=True)
                    continue
                conversation.messages.append({"role": "user", "content": text})
                conversation.save()
            full = tokenizer.encode_chat(conversation.messages)
            with _warnings_as_lines():
                if reopen:
                    state, new_ids = runner.attach_session(session, full, continue_stored=True)
                    answer_prefix = (state.tokens + list(new_ids))[len(full):]  # an interrupted answer's tokens
                    reopen = False
                else:
                    from .generate import continue_state

                    state, new_ids = continue_state(mdl, state, full)
                    if not new_ids:  # nothing new to feed (cannot happen with a template that adds a prompt)
                        state, new_ids = mdl.new_state(), full
            if answer_prefix:
                sys.stdout.write(tokenizer.decode(answer_prefix))
            answer = [tokenizer.decode(answer_prefix)] if answer_prefix else []
            stats = GenerationStats()
            try:
                for ev in gen.stream(new_ids, params, max(1, max_tokens - len(answer_prefix)), state=state,
                                     stats=stats):
                    answer.append(ev.text)
                    sys.stdout.write(ev.text)
                    sys.stdout.flush()
            except KeyboardInterrupt:
                typer.echo("\n[stopped]", err=True)
                if not state.rollback():
                    state = mdl.new_state()
                reopen = session is not None  # the session file is truncated to the state when reopened
            sys.stdout.write("\n")
            conversation.messages.append({"role": "assistant", "content": "".join(answer)})
            conversation.save()
            runner.end_turn()
            _accumulate(totals, stats)
            typer.echo(_status_line(stats), err=True)
        if totals.prompt_tokens:
            typer.echo(format_stats(totals), err=True)
    except ColibriError as exc:
        _fail(exc)
    finally:
        if runner is not None:
            runner.close()


def _accumulate(totals, s) -> None:
    totals.prompt_tokens += s.prompt_tokens
    totals.generated_tokens += s.generated_tokens
    totals.prefill_seconds += s.prefill_seconds
    totals.decode_seconds += s.decode_seconds
    totals.decode_steps += s.decode_steps
    totals.ttft_seconds = s.ttft_seconds
    e, t = s.experts, totals.experts
    t.requests += e.requests
    t.loaded += e.loaded
    t.hits += e.hits
    t.bytes_read += e.bytes_read
    t.tokens += e.tokens
    totals.peak_rss = max(totals.peak_rss, s.peak_rss)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
