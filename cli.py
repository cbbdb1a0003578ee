"""`dsconv`: the offline tools, one command per stage: `quantize` (convert/), `shard` and `plan` (shard/),
`verify` (manifest/, through shard/cli.py). The function signatures are the CLI."""

from __future__ import annotations

import typer

from dsconv.convert.cli import quantize
from dsconv.shard.cli import shard, verify
from dsconv.shard.plan_cli import plan

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Convert DeepSeek-V3/V3.2/V4 checkpoints to W8A8 INT8 and shard them for 16 cards.")


@app.callback()
def main() -> None:
    """Convert DeepSeek-V3/V3.2/V4 checkpoints to W8A8 INT8 and shard them for 16 cards."""


for command in (quantize, shard, verify, plan):
    app.command()(command)

if __name__ == "__main__":
    app()
