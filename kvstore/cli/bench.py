"""`kvstore bench URL`: MiB/s of a backend next to its plain-client baseline, same run."""

from __future__ import annotations

import asyncio
import json
import sys
import tempfile
from pathlib import Path

import click

from kvstore.options import kvstore_home, parse_size


def default_url() -> str:
    return (kvstore_home() / "bench").as_uri()


@click.command()
@click.argument("url", required=False)
@click.option(
    "--size", default="32MiB", show_default=True, help="Bytes per chunk (KV_2LTD bf16 shape when it divides)."
)
@click.option("--count", default=16, show_default=True, help="Chunks per pass.")
@click.option("--concurrency", default=4, show_default=True, help="Operations in flight, both sides.")
@click.option("--rounds", default=5, show_default=True, help="Alternating rounds; the median is reported.")
@click.option(
    "--cache",
    type=click.Choice(["cold", "warm"]),
    default="cold",
    show_default=True,
    help="file:// only: read from the device (drop the page cache first) or from the page cache.",
)
@click.option(
    "--through",
    type=click.Choice(["tier", "backend"]),
    default="tier",
    show_default=True,
    help="tier: the full stack (codec, frame, checksum verified on get); backend: the backend alone.",
)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
@click.option("--tmp", is_flag=True, help="Use a fresh temporary directory (file:// default only).")
def bench(
    url: str | None,
    through: str,
    size: str,
    count: int,
    concurrency: int,
    rounds: int,
    cache: str,
    as_json: bool,
    tmp: bool,
) -> None:
    """Put and get COUNT chunks through URL and through the plain baseline.

    URL defaults to a disk tier under $KVSTORE_HOME/bench.  The baseline is the
    plainest client for the same place: os.write+fsync / os.preadv for file://,
    redis-py SET/GET for redis://, aiobotocore put_object/get_object for s3://.
    """
    from tqdm import tqdm

    from kvstore.throughput.run import run_bench

    chunk = parse_size(size)
    if not chunk:
        raise click.BadParameter("size must be positive", param_hint="--size")
    tmpdir = None
    if url is None:
        if tmp:
            tmpdir = tempfile.TemporaryDirectory(prefix="kvstore-bench-")
            url = Path(tmpdir.name).as_uri()
        else:
            url = default_url()
    total = 4 * (rounds + 1) * count * chunk
    with tqdm(
        total=total,
        unit="B",
        unit_scale=True,
        unit_divisor=1024,
        desc="bench",
        file=sys.stderr,
        disable=as_json or not sys.stderr.isatty(),
    ) as bar:
        try:
            result = asyncio.run(
                run_bench(
                    url,
                    size=chunk,
                    count=count,
                    concurrency=concurrency,
                    rounds=rounds,
                    cache=cache,
                    through=through,
                    progress=bar.update,
                )
            )
        except (ValueError, RuntimeError, OSError) as exc:
            raise click.ClickException(str(exc)) from exc
        finally:
            if tmpdir is not None:
                tmpdir.cleanup()
    if as_json:
        click.echo(json.dumps(result.to_dict()))
        return
    click.echo(f"kvstore bench  {result.url}")
    click.echo(
        f"  {result.count} chunks x {chunk / (1 << 20):.1f} MiB {list(result.shape)} bf16, "
        f"concurrency {result.concurrency}, median of {result.rounds} rounds, cache {result.cache}, "
        f"through the {result.through}"
    )
    click.echo(f"  baseline: {result.baseline}")
    click.echo(f"  {'':6}{'kvstore MiB/s':>15}{'baseline MiB/s':>16}{'ratio':>8}")
    click.echo(
        f"  {'put':6}{result.put_mib_s:>15.0f}{result.baseline_put_mib_s:>16.0f}{result.put_ratio:>8.2f}"
    )
    click.echo(
        f"  {'get':6}{result.get_mib_s:>15.0f}{result.baseline_get_mib_s:>16.0f}{result.get_ratio:>8.2f}"
    )
