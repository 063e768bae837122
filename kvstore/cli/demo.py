"""``kvstore demo``: show LMCache loading KV from kvstore instead of recomputing it.

Owns: the command's options and how the report is shown (table or ``--json``).
Must not touch: the demo's logic (`kvstore.demo.run`).
"""

from __future__ import annotations

import json
import os
import sys

import click

from kvstore.store_config import StoreConfigError, TierConfig


def _render(rep) -> None:
    moved = {"shm": "KV to the worker through /dev/shm"}.get(rep.transfer, "KV to the worker inside the requests")
    how = (
        f"LMCache MP server, kvstore as its L2 adapter, {moved}"
        if rep.path == "mp"
        else f"LMCache engine in-process ({rep.path} path, {'async' if rep.async_loading else 'sync'} loading)"
    )
    click.echo(f"\nkvstore demo — {rep.model} on CPU, {how}, chunk {rep.chunk_size} tokens")
    click.echo(f"model load {rep.model_load_s:.1f}s\n")
    first = rep.passes[0]
    for p in rep.passes:
        click.echo(f"== {p.name}")
        click.echo("   tiers: " + ", ".join(f"{t['url']} [{t['codec']}]" for t in p.tiers))
        for i, r in enumerate(p.prompts):
            if p is first:
                click.echo(f"   prompt {i}: {r.prompt_tokens} tokens, prefill {r.compute_s:.2f}s, KV stored")
                continue
            tiers = (
                ", ".join(
                    f"{n} {t} tok / {r.bytes_by_tier.get(n, 0) / 2**20:.1f} MiB"
                    for n, t in r.tokens_by_tier.items()
                )
                or "none"
            )
            base = first.prompts[i].compute_s
            total = r.load_s + r.compute_s
            verdict = "identical" if r.identical else f"{r.agreement:.0%} of tokens agree"
            click.echo(
                f"   prompt {i}: hit {r.hit_tokens}/{r.prompt_tokens} tokens ({tiers})\n"
                f"      load {r.load_s:.3f}s + prefill of the rest {r.compute_s:.2f}s = {total:.2f}s "
                f"vs full prefill {base:.2f}s ({base / total if total else 0:.1f}x); continuation {verdict}"
            )
    click.echo("\ncontinuations (first run):")
    for c in rep.continuations:
        click.echo(f"   {c!r}")


@click.command("demo")
@click.option(
    "--tier",
    "tiers",
    multiple=True,
    metavar="URL",
    help="A tier URL, hottest first (repeat). Replaces the embedded memory+disk+cold default.",
)
@click.option("--cold-codec", default=None, help="Codec of the last tier (e.g. cachegen or raw).")
@click.option("--prompts", default=2, show_default=True, help="How many prompts.")
@click.option(
    "--prompt-tokens",
    default=769,
    show_default=True,
    help="Tokens per prompt (3 chunks of 256 + the one always computed).",
)
@click.option("--new-tokens", default=12, show_default=True, help="Tokens decoded after each prompt.")
@click.option("--chunk-size", default=256, show_default=True, help="LMCache chunk size in tokens.")
@click.option(
    "--path",
    type=click.Choice(["mp", "plugin", "remote"]),
    default="mp",
    show_default=True,
    help="mp: a real `lmcache server` with kvstore as its L2 adapter (LMCache's default mode); "
    "plugin / remote: the in-process engine with kvstore as storage plugin / remote connector.",
)
@click.option("--async-loading", is_flag=True, help="Use LMCache's async loading (lookup + prefetch).")
@click.option("--threads", type=int, default=None, help="torch CPU threads (default: torch's).")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
def demo(
    tiers, cold_codec, prompts, prompt_tokens, new_tokens, chunk_size, path, async_loading, threads, as_json
):
    """Run a real model through LMCache twice: the second time its KV comes back from kvstore."""
    os.environ.setdefault("LMCACHE_LOG_LEVEL", "ERROR")
    from tqdm import tqdm

    from kvstore.demo.run import default_demo_tiers, run_demo, steps_total
    from kvstore.options import kvstore_home
    from kvstore.store_config import StoreConfig

    try:
        chosen = [TierConfig(u) for u in tiers] if tiers else default_demo_tiers(kvstore_home())
        if cold_codec:
            chosen[-1] = TierConfig(chosen[-1].url, cold_codec)
        StoreConfig(tiers=tuple(chosen)).validate()
    except (StoreConfigError, ValueError) as exc:
        raise click.UsageError(str(exc)) from None

    bar = tqdm(total=steps_total(chosen, prompts), desc="demo", file=sys.stderr, leave=False, disable=False)

    def step(msg: str) -> None:
        bar.set_postfix_str(msg)
        bar.update(1)

    try:
        if path == "mp":
            from kvstore.demo.mp import run_demo_mp

            rep = run_demo_mp(
                chosen,
                prompts=prompts,
                prompt_tokens=prompt_tokens,
                new_tokens=new_tokens,
                chunk_size=chunk_size,
                threads=threads,
                step=step,
            )
        else:
            rep = run_demo(
                chosen,
                prompts=prompts,
                prompt_tokens=prompt_tokens,
                new_tokens=new_tokens,
                chunk_size=chunk_size,
                path=path,
                async_loading=async_loading,
                threads=threads,
                step=step,
            )
    finally:
        bar.close()
    if as_json:
        click.echo(json.dumps(rep.to_dict(), indent=2))
    else:
        _render(rep)


if __name__ == "__main__":
    demo()
