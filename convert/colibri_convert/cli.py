"""Command line of colibri_convert: Convert Hugging Face MoE checkpoints to Colibri containers."""

from __future__ import annotations

import typer

app = typer.Typer(help="Convert Hugging Face MoE checkpoints to Colibri containers.", no_args_is_help=True, add_completion=False)


@app.command()
def version() -> None:
    """Print the version."""
    from colibri_format import __version__

    typer.echo(__version__)


def main() -> None:
    app()
