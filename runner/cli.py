"""`dsrun`: the distributed runner. Not built yet: every command says so and exits non-zero."""

from __future__ import annotations

import typer
from rich.console import Console

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Run DeepSeek shards on 16 ranks (not implemented yet).")


@app.callback()
def main() -> None:
    """Run DeepSeek shards on 16 ranks (not implemented yet)."""


@app.command()
def generate() -> None:
    """Generate text from sharded weights (not implemented yet)."""
    Console(stderr=True).print("[bold red]error:[/] dsrun generate is not implemented yet; "
                               "only `dsconv quantize` works in this release")
    raise typer.Exit(1)
