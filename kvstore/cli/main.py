"""The `kvstore` command line: one click group; subcommands load lazily.

Owns: the command table and top-level error handling (a clear message and exit code
2 for bad input, 1 for failures).  Each subcommand lives in its own module under
kvstore/cli/ and is imported only when invoked, so `kvstore --help` stays fast.
"""

from __future__ import annotations

import importlib
import logging
import sys

import click

COMMANDS: dict[str, str] = {
    "bench": "kvstore.cli.bench:bench",
    "demo": "kvstore.cli.demo:demo",
    "doctor": "kvstore.cli.doctor:doctor",
    "codec": "kvstore.cli.codec:codec",
    "migrate": "kvstore.cli.ops:migrate",
    "ls": "kvstore.cli.ops:ls",
    "stat": "kvstore.cli.ops:stat",
    "verify": "kvstore.cli.ops:verify",
    "gc": "kvstore.cli.ops:gc",
    "simulate": "kvstore.cli.simulate:simulate",
}


class LazyGroup(click.Group):
    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(COMMANDS)

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        target = COMMANDS.get(cmd_name)
        if target is None:
            return None
        module, _, attr = target.partition(":")
        return getattr(importlib.import_module(module), attr)


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("-v", "--verbose", count=True, help="More logging (-v info, -vv debug).")
@click.version_option(package_name="kvstore")
def cli(verbose: int) -> None:
    """kvstore: an asyncio object store for LLM KV-cache chunks (under LMCache / vLLM)."""
    level = logging.WARNING - 10 * min(verbose, 2)
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)


def main() -> None:
    cli(prog_name="kvstore")


if __name__ == "__main__":
    main()
