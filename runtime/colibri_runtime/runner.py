"""A running model as the command line uses it: container, tier cache, model, tokenizer, generator, usage history,
optional persistent session and routing trace, and the end-of-run report.

`Runner.open(...)` assembles the pieces; `end_turn()` folds the turn's routing into `.coli_usage`; `close()` writes the
trace and releases files and threads.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from pathlib import Path

from colibri_format.errors import ColibriError
from colibri_format.units import human_bytes

from . import timesplit
from .generate import GenerationStats, Generator, human_seconds
from .placement import Budget, PlacementOptions, build_provider, save_usage

DEFAULT_MODEL_DIR = Path(__file__).with_name("default_model")


def resolve_model_dir(model: Path | None) -> Path:
    """The container to run: the one given, else the default model shipped with Colibri."""
    if model is not None:
        return Path(model)
    if (DEFAULT_MODEL_DIR / "colibri.json").is_file():
        return DEFAULT_MODEL_DIR
    raise ColibriError(
        "no --model given and the default model is not installed; pass --model DIR (a container made by "
        "colibri-convert)"
    )


@dataclass
class Runner:
    model_dir: Path
    container: object
    model: object
    tokenizer: object
    generator: Generator
    provider: object
    budget: Budget
    usage: object
    usage_path: Path
    trace_path: Path | None = None
    recorder: object = None
    session: object = None
    split_start: timesplit.TimeSplit = field(default_factory=timesplit.SPLIT.snapshot)

    @classmethod
    def open(
        cls,
        model_dir: Path | None,
        options: PlacementOptions,
        trace_path: Path | None = None,
        dsa_select_all: bool = False,
    ) -> Runner:
        from colibri_format.reader import Container

        from .loader import load_model
        from .tokenizer import ChatTokenizer
        from .trace import TraceRecorder

        path = resolve_model_dir(model_dir)
        container = Container.open(path)
        try:
            recorder = None
            if trace_path is not None:
                main = [layer for layer in container.expert_layers
                        if layer < int(container.config.get("num_hidden_layers", 1 << 30))]
                top_k = int(container.config.get("num_experts_per_tok") or container.config.get("top_k") or 1)
                recorder = TraceRecorder(main, top_k, container.num_experts, container.fingerprint)
            provider, budget, usage, usage_path = build_provider(container, options, trace=recorder)
            if dsa_select_all:
                container.config["colibri_dsa"] = "all"
            model = load_model(path, experts=provider, container=container)
            tokenizer = ChatTokenizer(path, model.config)
        except BaseException:
            container.close()
            raise
        return cls(path, container, model, tokenizer, Generator(model, tokenizer), provider, budget, usage,
                   usage_path, trace_path, recorder)

    def attach_session(self, name: str, prompt_ids: list[int], continue_stored: bool = False):
        """Open (or create) the persistent session NAME for a conversation whose rendered prompt is prompt_ids;
        returns (state, ids still to feed). Every forward from now on is committed to the session file."""
        from .session import ModelSession, SessionWarning, session_path

        if self.session is None:
            self.session = ModelSession(self.model, session_path(name), self.container.fingerprint)
            self.generator.after_forward = self.session.commit
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", SessionWarning)
            state, feed = self.session.open(prompt_ids, continue_stored=continue_stored)
        for w in caught:
            warnings.warn(str(w.message), SessionWarning, stacklevel=2)
        return state, list(feed)

    def end_turn(self) -> None:
        """Fold this turn's routing decisions into the usage history (written atomically)."""
        save_usage(self.usage, self.usage_path, self.provider.take_turn_counts())

    def tier_report(self) -> str:
        s = self.provider.stats
        split = timesplit.SPLIT.since(self.split_start)
        lines = []
        loaded = max(1, s.loaded)
        lines.append(
            f"experts: {s.per_token:.1f} loaded/token | hits {100 * s.hits / loaded:.1f}% (pinned "
            f"{100 * s.pinned_hits / loaded:.1f}%, LRU {100 * s.lru_hits / loaded:.1f}%, prefetched "
            f"{100 * s.prefetch_hits / loaded:.1f}%) | misses {100 * s.misses / loaded:.1f}%"
        )
        if s.predicted:
            lines.append(
                f"prefetch: precision {100 * s.precision:.1f}% | recall {100 * s.recall:.1f}% | "
                f"{s.prefetch_reads} reads, {s.prefetch_wasted} unused"
            )
        drives = ", ".join(f"{name} {human_bytes(n)}" for name, n in sorted(s.bytes_by_drive.items())) or "none"
        lines.append(f"read: {human_bytes(s.bytes_read)} at {s.read_gbps:.2f} GB/s per read | by drive: {drives}")
        expert_compute = max(0.0, split.moe - s.disk_wait_seconds)
        lines.append(
            f"time: attention {human_seconds(split.attention)} | experts {human_seconds(expert_compute)} | "
            f"disk wait {human_seconds(s.disk_wait_seconds)}"
        )
        b = self.budget
        lines.append(
            f"memory budget {human_bytes(b.total)}: resident {human_bytes(b.resident)}, attention state "
            f"{human_bytes(b.kv)}, buffers {human_bytes(b.working)}, expert cache {human_bytes(b.experts)} "
            f"(holding {human_bytes(self.provider.cached_bytes)})"
        )
        return "\n".join(lines)

    def report(self, stats: GenerationStats) -> str:
        from .generate import format_stats

        return format_stats(stats) + "\n" + self.tier_report()

    def close(self) -> None:
        try:
            if self.recorder is not None and self.trace_path is not None:
                self.recorder.trace().save(self.trace_path)
        finally:
            if self.session is not None:
                self.session.close()
            self.provider.close()
            self.container.close()
