"""Command line of colibri_inspect: Verify and plan Colibri containers."""

from __future__ import annotations

import typer

app = typer.Typer(help="Verify and plan Colibri containers.", no_args_is_help=True, add_completion=False)


@app.command()
def version() -> None:
    """Print the version."""
    from colibri_format import __version__

    typer.echo(__version__)


def main() -> None:
    app()
