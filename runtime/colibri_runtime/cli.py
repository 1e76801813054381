"""Command line of colibri_runtime: `colibri-run generate` and `colibri-run chat` on a Colibri container.

Generated text goes to stdout as it is produced; statistics, status lines and errors go to stderr. Errors the
library raises on purpose (ColibriError) end the program with one line and exit status 1.
"""

from __future__ import annotations

import sys
from pathlib import Path

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


def _open(model_dir: Path):
    from .generate import Generator
    from .loader import load_model
    from .tokenizer import ChatTokenizer

    model = load_model(model_dir)
    tokenizer = ChatTokenizer(model_dir, model.config)
    return model, tokenizer, Generator(model, tokenizer)


def _params(temperature: float, top_p: float, top_k: int, seed: int | None, repetition_penalty: float):
    from .sampling import SamplingParams

    return SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p,
                          repetition_penalty=repetition_penalty, seed=seed)


@app.command()
def generate(
    prompt: str = typer.Argument(..., help="The prompt text."),
    model: Path = typer.Option(..., "--model", "-m", help="Colibri container directory."),  # noqa: B008
    max_tokens: int = typer.Option(256, "--max-tokens", "-n", help="Most tokens to generate."),
    temperature: float = typer.Option(0.0, help="Sampling temperature; 0 is greedy."),
    top_p: float = typer.Option(1.0, "--top-p", help="Nucleus sampling mass (1 = off)."),
    top_k: int = typer.Option(0, "--top-k", help="Sample among the k most likely tokens (0 = off)."),
    seed: int | None = typer.Option(None, help="Random seed for sampling."),
    repetition_penalty: float = typer.Option(1.0, "--repetition-penalty", help="1 = off."),
    stop: list[str] = typer.Option([], "--stop", help="Stop when the text contains this string (repeatable)."),  # noqa: B008
    chat: bool = typer.Option(False, "--chat", help="Wrap the prompt in the model's chat template."),
    stats: bool = typer.Option(True, "--stats/--no-stats", help="Print run statistics to stderr at the end."),
) -> None:
    """Complete PROMPT and stream the completion to stdout."""
    from .generate import format_stats

    try:
        params = _params(temperature, top_p, top_k, seed, repetition_penalty)
        _, tokenizer, gen = _open(model)
        ids = (tokenizer.encode_chat([{"role": "user", "content": prompt}]) if chat
               else tokenizer.encode(prompt))
        try:
            for ev in gen.stream(ids, params, max_tokens, stop_strings=stop):
                sys.stdout.write(ev.text)
                sys.stdout.flush()
        except KeyboardInterrupt:
            typer.echo("\n[interrupted]", err=True)
        sys.stdout.write("\n")
        if stats and gen.last_stats is not None:
            typer.echo(format_stats(gen.last_stats), err=True)
    except ColibriError as exc:
        _fail(exc)


# --- chat -----------------------------------------------------------------------------------------------------------

CHAT_HELP = "Commands: /reset (new conversation), /stats (totals so far), /quit (leave). Ctrl-C stops an answer."


def _status_line(stats) -> str:
    from .generate import human_bytes, human_seconds, rss_bytes

    e = stats.experts
    return (f"[{stats.decode_tps:.2f} tok/s | TTFT {human_seconds(stats.ttft_seconds)} | hit {100 * e.hit_rate:.0f}% "
            f"| read {human_bytes(e.bytes_read)} | RSS {human_bytes(rss_bytes())}]")


@app.command()
def chat(
    model: Path = typer.Option(..., "--model", "-m", help="Colibri container directory."),  # noqa: B008
    max_tokens: int = typer.Option(512, "--max-tokens", "-n", help="Most tokens per answer."),
    temperature: float = typer.Option(0.0, help="Sampling temperature; 0 is greedy."),
    top_p: float = typer.Option(1.0, "--top-p"),
    top_k: int = typer.Option(0, "--top-k"),
    seed: int | None = typer.Option(None),
    repetition_penalty: float = typer.Option(1.0, "--repetition-penalty"),
    system: str | None = typer.Option(None, help="A system message opening the conversation."),
    session: str | None = typer.Option(None, help="Name of a persistent session (kept across runs)."),
) -> None:
    """Interactive multi-turn chat with a status line after each answer."""
    from .generate import GenerationStats, continue_state, format_stats

    try:
        params = _params(temperature, top_p, top_k, seed, repetition_penalty)
        mdl, tokenizer, gen = _open(model)
        if session is not None:
            typer.echo("colibri-run: note: --session state is kept for this run only in this version", err=True)
        typer.echo(CHAT_HELP, err=True)
        messages: list[dict] = [] if system is None else [{"role": "system", "content": system}]
        state = mdl.new_state()
        totals = GenerationStats()
        while True:
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
                messages = [] if system is None else [{"role": "system", "content": system}]
                state = mdl.new_state()
                typer.echo("[conversation reset]", err=True)
                continue
            if text == "/stats":
                typer.echo(format_stats(totals), err=True)
                continue
            messages.append({"role": "user", "content": text})
            # Keep the attention state when the rendered conversation extends it; re-prefill otherwise.
            state, new_ids = continue_state(mdl, state, tokenizer.encode_chat(messages))
            answer = []
            stats = GenerationStats()
            try:
                for ev in gen.stream(new_ids, params, max_tokens, state=state, stats=stats):
                    answer.append(ev.text)
                    sys.stdout.write(ev.text)
                    sys.stdout.flush()
            except KeyboardInterrupt:
                typer.echo("\n[stopped]", err=True)
                if not state.rollback():
                    state = mdl.new_state()
            sys.stdout.write("\n")
            messages.append({"role": "assistant", "content": "".join(answer)})
            _accumulate(totals, stats)
            typer.echo(_status_line(stats), err=True)
        typer.echo(format_stats(totals), err=True)
    except ColibriError as exc:
        _fail(exc)


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
