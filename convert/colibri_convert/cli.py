"""Command line of colibri_convert: `convert`, `export-hf` and `publish`.

Library code raises ColibriError; this module is the edge that catches it, prints one line saying what is wrong and
what to do, and exits non-zero (1 for errors, 3 when the free-space floor stopped a resumable conversion).
"""

from __future__ import annotations

import sys
from pathlib import Path

import typer

from colibri_format.errors import ColibriError
from colibri_format.units import human_bytes

app = typer.Typer(help="Convert Hugging Face MoE checkpoints to Colibri containers.", no_args_is_help=True,
                  add_completion=False)

EXIT_ERROR = 1
EXIT_DISK_FLOOR = 3


def _fail(exc: BaseException, code: int = EXIT_ERROR) -> None:
    typer.echo(f"colibri-convert: error: {exc}", err=True)
    raise typer.Exit(code)


class _RichProgress:
    """Progress bars: the current shard (bytes) and the whole conversion (shards)."""

    def __init__(self):
        from rich.progress import (
            BarColumn,
            DownloadColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeRemainingColumn,
            TransferSpeedColumn,
        )

        self.bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), DownloadColumn(),
                            TransferSpeedColumn(), TimeRemainingColumn(), transient=False)
        self.overall = None
        self.shard = None

    def start(self, units, done):
        self.bar.start()
        self.overall = self.bar.add_task("all shards", total=sum(s or 0 for _, s in units) or None)
        self._units = dict(units)
        for _, size in units[:done]:
            self.bar.advance(self.overall, size or 0)

    def unit_start(self, name, nbytes, ntensors):
        if self.shard is not None:
            self.bar.remove_task(self.shard)
        self.shard = self.bar.add_task(f"{name} ({ntensors} tensors)", total=nbytes)

    def tensor_done(self, nbytes):
        self.bar.advance(self.shard, nbytes)

    def unit_done(self, name, nbytes):
        self.bar.advance(self.overall, self._units.get(name) or nbytes)

    def finalizing(self):
        self.stop()

    def stop(self):
        self.bar.stop()


def _print_summary(s) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(stderr=False)
    rate = s.throughput_gbps * 1e9
    console.print(f"[bold]{s.out_dir}[/bold]: {s.family}, {s.units} shard(s) ({s.units_resumed} resumed), "
                  f"container {human_bytes(s.container_bytes)}, {s.seconds:.1f} s, "
                  f"{human_bytes(rate)}/s of source read, MTP layers {list(s.mtp_layers) or 'none'}")
    table = Table("tensor class", "tensors", "source", "stored", "worst rel. RMSE", "worst tensor")
    for cls, q in s.quant.items():
        table.add_row(cls, str(q["tensors"]), human_bytes(q["source_bytes"]), human_bytes(q["stored_bytes"]),
                      f"{q['worst_relative_rmse']:.4f}", q["worst_tensor"])
    console.print(table)


@app.command()
def convert(
    source: str = typer.Argument(..., help="Local checkpoint folder or Hub repo id (org/name)."),
    out_dir: Path = typer.Argument(..., help="Container directory to write (resumed if a conversion was interrupted)."),
    revision: str | None = typer.Option(None, help="Hub revision (branch, tag or commit)."),
    min_free_gb: float = typer.Option(0.0, help="Stop cleanly (resumable) when free space would fall below this."),
    restart: bool = typer.Option(False, help="Discard any partial conversion in OUT_DIR and start over."),
    experts: str | None = typer.Option(None, help="Encoding of routed experts (default int4_gs64)."),
    shared_experts: str | None = typer.Option(None, help="Encoding of shared experts (default int4_gs64)."),
    dense_mlp: str | None = typer.Option(None, help="Encoding of dense MLP layers (default int4_gs64)."),
    attention: str | None = typer.Option(None, help="Encoding of attention projections (default int4_gs64)."),
    embeddings: str | None = typer.Option(None, help="Encoding of token embeddings (default int8_gs64)."),
    lm_head: str | None = typer.Option(None, help="Encoding of the output head (default int8_gs64)."),
    mtp: str | None = typer.Option(None, help="Encoding of MTP layers (default int8_gs64)."),
    quiet: bool = typer.Option(False, help="No progress bars."),
) -> None:
    """Convert a Hugging Face MoE checkpoint into a Colibri container, shard by shard, resumably."""
    from .convert import DiskFloorReached
    from .convert import convert as run_convert
    from .sources import open_source

    overrides = {k: v for k, v in (("routed_experts", experts), ("shared_experts", shared_experts),
                                    ("dense_mlp", dense_mlp), ("attention", attention), ("embeddings", embeddings),
                                    ("lm_head", lm_head), ("mtp", mtp)) if v is not None}
    progress = None if quiet else _RichProgress()
    try:
        summary = run_convert(open_source(source, revision), out_dir, overrides, min_free_gb=min_free_gb,
                              restart=restart, progress=progress)
    except DiskFloorReached as exc:
        _stop(progress)
        _fail(exc, EXIT_DISK_FLOOR)
    except ColibriError as exc:
        _stop(progress)
        _fail(exc)
    except KeyboardInterrupt:
        _stop(progress)
        _fail(KeyboardInterrupt("interrupted; run the same command again to resume"), 130)
    _print_summary(summary)


def _stop(progress) -> None:
    if progress is not None:
        progress.stop()


@app.command("export-hf")
def export_hf(
    container: Path = typer.Argument(..., help="Colibri container directory."),
    out_dir: Path = typer.Argument(..., help="New directory for the Hugging Face checkpoint."),
    dtype: str = typer.Option("f32", help="Weight dtype written: f32, f16 or bf16."),
) -> None:
    """Write a container back as a Hugging Face checkpoint with dequantized weights."""
    from .export import export_hf as run_export

    try:
        path = run_export(container, out_dir, dtype=dtype)
    except ColibriError as exc:
        _fail(exc)
    typer.echo(f"wrote {path}")


@app.command()
def publish(
    container: Path = typer.Argument(..., help="Colibri container directory."),
    repo_id: str = typer.Argument(..., help="Hub model repo to upload to (org/name)."),
    dry_run: bool = typer.Option(False, help="List what would be uploaded and stop."),
    private: bool = typer.Option(False, help="Create the repo as private."),
) -> None:
    """Verify a container and upload it to the Hugging Face Hub with a generated model card."""
    from .publish import publish as run_publish

    try:
        files = run_publish(container, repo_id, dry_run=dry_run, private=private)
    except ColibriError as exc:
        _fail(exc)
    total = sum(f.size for f in files)
    for f in files:
        typer.echo(f"{f.size:>14,d}  {f.name}")
    verb = "would upload" if dry_run else "uploaded"
    typer.echo(f"{verb} {len(files)} files, {total:,d} bytes to {repo_id}")


@app.command()
def version() -> None:
    """Print the version."""
    from colibri_format import __version__

    typer.echo(__version__)


def main() -> None:
    app()


if __name__ == "__main__":
    sys.exit(main())
