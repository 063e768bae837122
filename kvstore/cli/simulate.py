"""`kvstore simulate`: replay a request trace through modelled tiers and placement policies.

Owns: the click command (register ``kvstore.cli.simulate:simulate``).  Must not touch:
policy logic (that is `kvstore.policy`; the live store runs the same objects).

Fixed contract, so the same command runs on any Mooncake-format trace::

    kvstore simulate --trace FILE --capacity-fraction F --policy NAME --json

prints one JSON object with at least ``policy``, ``capacity_blocks``, ``requests``,
``block_refs``, ``prefix_hits`` and ``hit_ratio`` (one tier holding F × the trace's
distinct blocks, equal-size blocks).  ``--tiers`` models several tiers instead, e.g.
``--tiers hot:5%:20GB,disk:1TiB:2GB:lru`` (NAME:CAPACITY[:BANDWIDTH[:POLICY]], capacity in
bytes or as a percentage of the distinct blocks, bandwidth in bytes per second).
"""

from __future__ import annotations

import json
import re
import time

import click

from kvstore.options import parse_size
from kvstore.policy import DEFAULT_POLICY, POLICIES
from kvstore.policy import simulate as sim
from kvstore.policy.trace import distinct_blocks, read_trace

_DEFAULT_BANDWIDTH = [20 * sim.GB, 2 * sim.GB, 0.5 * sim.GB]  # memory, local disk, object storage


def _parse_bandwidth(text: str) -> float:
    m = re.fullmatch(r"\s*([0-9.]+)\s*([A-Za-z]*?)(?:/s)?\s*", text)
    if not m:
        raise click.BadParameter(f"cannot read bandwidth {text!r}; write e.g. 2GB or 500MB")
    size = parse_size(m.group(1) + m.group(2))
    return float(size or 0)


def parse_tiers(spec: str, distinct: int, block_bytes: int, default_policy: str) -> list[sim.TierModel]:
    """``NAME:CAPACITY[:BANDWIDTH[:POLICY]]``, comma-separated, hot first."""
    tiers = []
    for i, item in enumerate(s for s in spec.split(",") if s.strip()):
        fields = item.strip().split(":")
        if len(fields) < 2 or len(fields) > 4:
            raise click.BadParameter(f"tier {item!r}: write NAME:CAPACITY[:BANDWIDTH[:POLICY]]")
        name, cap = fields[0], fields[1]
        if cap.endswith("%"):
            capacity = int(float(cap[:-1]) / 100 * distinct) * block_bytes
        else:
            try:
                capacity = parse_size(cap) or 0
            except ValueError as exc:
                raise click.BadParameter(str(exc)) from None
        bw = _parse_bandwidth(fields[2]) if len(fields) > 2 else _DEFAULT_BANDWIDTH[min(i, 2)]
        policy = fields[3] if len(fields) > 3 else default_policy
        if policy not in POLICIES:
            raise click.BadParameter(f"unknown policy {policy!r}; choose one of {sorted(POLICIES)}")
        tiers.append(sim.TierModel(capacity=capacity, policy=policy, name=name, bandwidth=bw))
    if not tiers:
        raise click.BadParameter("--tiers names no tier")
    return tiers


def _print_text(res: sim.SimResult, seconds: float) -> None:
    click.echo(
        f"policy {res.policy}: {res.requests} requests, {res.block_refs} block refs, "
        f"{res.distinct_blocks} distinct blocks"
    )
    click.echo(f"prefix hits {res.prefix_hits} — hit ratio {res.hit_ratio:.4f}")
    click.echo(
        f"{'tier':<10}{'policy':<10}{'capacity':>16}{'hits':>10}{'ratio':>8}{'read':>14}{'written':>14}{'evicted':>10}"
    )
    for t in res.tiers:
        click.echo(
            f"{t.name:<10}{t.policy:<10}{t.capacity:>16}{t.hits:>10}{t.hit_ratio:>8.4f}"
            f"{t.bytes_read:>14}{t.bytes_written:>14}{t.evictions:>10}"
        )
    click.echo(
        f"modelled load time {res.load_seconds:.1f} s for {res.recompute_seconds_saved:.1f} s of prefill saved "
        f"(of {res.recompute_seconds_total:.1f} s) — replayed in {seconds:.2f} s"
    )


@click.command("simulate")
@click.option(
    "--trace",
    "trace_path",
    required=True,
    type=click.Path(exists=True, dir_okay=False),
    help="Mooncake-format JSONL trace.",
)
@click.option(
    "--capacity-fraction",
    type=float,
    default=0.1,
    show_default=True,
    help="One tier holding this fraction of the distinct blocks.",
)
@click.option(
    "--policy",
    default=DEFAULT_POLICY,
    show_default=True,
    type=click.Choice(sorted(POLICIES)),
    help="Policy for every tier without its own.",
)
@click.option("--tiers", default=None, help="Multi-tier model, e.g. 'hot:5%:20GB,disk:1TiB:2GB:lru'.")
@click.option(
    "--block-bytes",
    default="64MiB",
    show_default=True,
    help="Bytes per 512-token block (Llama-3.1-8B fp16: 64MiB).",
)
@click.option(
    "--prefill-tokens-per-s",
    type=float,
    default=10_000.0,
    show_default=True,
    help="Recompute speed, for the load-vs-recompute estimate.",
)
@click.option(
    "--skip", type=int, default=0, help="Skip this many requests first (e.g. to replay a held-out half)."
)
@click.option("--limit", type=int, default=None, help="Replay at most this many requests.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def simulate_command(
    trace_path: str,
    capacity_fraction: float,
    policy: str,
    tiers: str | None,
    block_bytes: str,
    prefill_tokens_per_s: float,
    skip: int,
    limit: int | None,
    as_json: bool,
) -> None:
    """Replay a trace through modelled tiers and report hit ratios, bytes moved and load time."""
    requests = read_trace(trace_path, limit=None if limit is None else skip + limit)[skip:]
    if not requests:
        raise click.UsageError("the trace (after --skip/--limit) has no requests")
    bb = parse_size(block_bytes) or 1
    distinct = distinct_blocks(requests)
    if tiers:
        models = parse_tiers(tiers, distinct, bb, policy)
    else:
        if not 0 < capacity_fraction <= 1:
            raise click.BadParameter("--capacity-fraction must be in (0, 1]")
        models = [sim.TierModel(capacity=int(capacity_fraction * distinct) * bb, policy=policy, name="tier0")]
    t0 = time.perf_counter()
    try:
        res = sim.simulate(requests, models, block_bytes=bb, prefill_tokens_per_s=prefill_tokens_per_s)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    seconds = time.perf_counter() - t0
    if as_json:
        out = res.to_dict()
        out["seconds"] = round(seconds, 3)
        click.echo(json.dumps(out))
    else:
        _print_text(res, seconds)


simulate = simulate_command
