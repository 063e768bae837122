"""`kvstore migrate | ls | stat | verify | gc`: operate on whole stores by URL.

Exit codes: 0 done; 1 done with failures (objects not copied, corrupt frames found,
deletes that failed, a listing that could not read everything); 2 bad input (URL,
option); 3 a backend cannot be reached or used (a listing that failed part way on S3).
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import click

from kvstore.backends import Backend, open_backend
from kvstore.backends.base import BackendUnavailableError
from kvstore.keys import printable_name
from kvstore.options import option_size, parse_duration, parse_size
from kvstore.redact import redact_text
from kvstore.tier_options import TierOptions

T = TypeVar("T")
EXIT_FAILURES, EXIT_USAGE, EXIT_UNAVAILABLE = 1, 2, 3


def _open(url: str, what: str) -> Backend:
    """Open a URL; only a migration's destination may be created, every other store must
    exist (``ls`` of a mistyped path is an error, not a new empty store).  A tier URL
    copied from a store's configuration works as written: its store options are read as
    a store reads them (`TierOptions`; ``capacity`` stays the medium's budget)."""
    try:
        backend_url, _ = TierOptions.parse(url)
        return open_backend(backend_url, create=what == "DST_URL")
    except ValueError as exc:
        raise click.BadParameter(redact_text(str(exc)), param_hint=what) from exc


def _run(main: Callable[..., Awaitable[T]], *urls: tuple[str, str]) -> T:
    """Open the backends, check them, run `main(*backends)`, close them; map errors to exits."""

    async def go() -> T:
        backends = [_open(url, what) for url, what in urls]
        try:
            for b in backends:
                await b.check()
            return await main(*backends)
        finally:
            for b in backends:
                await b.close()

    try:
        return asyncio.run(go())
    except BackendUnavailableError as exc:
        click.echo(f"Error: {redact_text(str(exc))}", err=True)
        sys.exit(EXIT_UNAVAILABLE)


def _bar(total: int, desc: str, quiet: bool) -> Any:
    from tqdm import tqdm

    return tqdm(
        total=total,
        unit="B",
        unit_scale=True,
        unit_divisor=1024,
        desc=desc,
        file=sys.stderr,
        disable=quiet or not sys.stderr.isatty(),
    )


def _report_unlisted(unlisted: list[tuple[str, str]]) -> bool:
    """Say on stderr what a listing could not read; True if there was anything."""
    for what, why in unlisted:
        click.echo(f"unreadable, not listed: {printable_name(what)}: {printable_name(why)}", err=True)
    return bool(unlisted)


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return str(n)


@click.command()
@click.argument("src_url")
@click.argument("dst_url")
@click.option("--namespace", help="Only this namespace (tenant).")
@click.option("--model", help="Only this model.")
@click.option("--prefix", default="", help="Only object names starting with this.")
@click.option(
    "--recode",
    help="Re-encode payloads on the way: raw, cachegen, or a spec like 'cachegen?profile=smollm2-135m'.",
)
@click.option(
    "--delete-source",
    is_flag=True,
    help="At the end, delete each source object whose verified copy the destination still holds "
    "(refused for a destination that may drop objects: capacity=, a TTL, an evicting Redis or one "
    "with no append-only file, an S3 lifecycle expiry, mem://, fsync=false; for the source itself "
    "under another URL or a prefix overlapping it; and with --no-verify-after-write).",
)
@click.option("--dry-run", is_flag=True, help="Say what would be copied; write nothing.")
@click.option("--concurrency", default=4, show_default=True, type=click.IntRange(min=1))
@click.option("--max-inflight", default="512MiB", show_default=True, help="Bytes held in memory at most.")
@click.option("--no-verify-after-write", is_flag=True, help="Skip reading each object back (not with --delete-source).")
@click.option("--fresh", is_flag=True, help="Forget what an earlier run of the same migration finished.")
@click.option("--json", "as_json", is_flag=True, help="Print the summary as one JSON object.")
def migrate(
    src_url: str,
    dst_url: str,
    namespace: str | None,
    model: str | None,
    prefix: str,
    recode: str | None,
    delete_source: bool,
    dry_run: bool,
    concurrency: int,
    max_inflight: str,
    no_verify_after_write: bool,
    fresh: bool,
    as_json: bool,
) -> None:
    """Copy every object from SRC_URL to DST_URL, verified, resumable and idempotent.

    A rerun after a kill finishes the job without copying again what is done.
    """
    from kvstore import codec as codecs
    from kvstore.ops.migrate import MigrateOptions, list_matching
    from kvstore.ops.migrate import migrate as run_migration

    if recode is not None:
        try:
            codecs.get(recode)
        except (ValueError, TypeError) as exc:
            raise click.BadParameter(redact_text(str(exc)), param_hint="--recode") from exc

    try:
        inflight = option_size("--max-inflight", max_inflight, unbounded=False)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--max-inflight") from exc
    try:
        opts = MigrateOptions(
            prefix=prefix,
            namespace=namespace,
            model=model,
            recode=recode,
            delete_source=delete_source,
            dry_run=dry_run,
            concurrency=concurrency,
            max_inflight_bytes=inflight or 512 << 20,
            verify_after_write=not no_verify_after_write,
            fresh=fresh,
        )
    except ValueError as exc:
        raise click.UsageError(str(exc)) from exc

    async def main(src: Backend, dst: Backend) -> Any:
        objects = await list_matching(src, opts)
        with _bar(sum(o.size for o in objects), "migrate", as_json) as bar:
            done = [0]

            def tick(n: int, nbytes: int) -> None:
                done[0] += n
                bar.set_postfix_str(f"{done[0]}/{len(objects)} objects", refresh=False)
                bar.update(nbytes)

            return await run_migration(src, dst, opts, progress=tick, objects=objects)

    try:
        report = _run(main, (src_url, "SRC_URL"), (dst_url, "DST_URL"))
    except ValueError as exc:
        raise click.UsageError(redact_text(str(exc))) from exc
    if as_json:
        click.echo(json.dumps(report.to_dict()))
    else:
        verb = "would copy" if dry_run else "copied"
        click.echo(
            f"{verb} {report.copied} of {report.listed} objects ({_human(report.copied_bytes)}) "
            f"in {report.seconds:.1f}s, {report.mib_s:.0f} MiB/s; already done {report.already_done}; "
            f"written {_human(report.written_bytes)}; deleted from source {report.deleted}"
        )
        for name in report.corrupt:
            click.echo(f"corrupt in source, skipped: {printable_name(name)}", err=True)
        for name in report.failed:
            click.echo(f"failed: {printable_name(name)}", err=True)
        for name in report.lost:
            click.echo(f"gone or changed in the destination, source kept: {printable_name(name)}", err=True)
    for name in report.not_deleted:
        click.echo(
            f"copied and checked, but the source delete failed (see -v); rerun to delete it: {printable_name(name)}",
            err=True,
        )
    if _report_unlisted(report.unlisted) or report.failed or report.lost or report.corrupt or report.not_deleted:
        sys.exit(EXIT_FAILURES)


@click.command(name="ls")
@click.argument("url")
@click.argument("prefix", default="")
@click.option("--namespace", help="Only this namespace.")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per line.")
def ls(url: str, prefix: str, namespace: str | None, as_json: bool) -> None:
    """List objects under PREFIX with their sizes and ages."""
    from kvstore.ops.inspect import list_objects

    async def main(b: Backend) -> tuple[list[Any], list[tuple[str, str]]]:
        return await list_objects(b, prefix, namespace), list(b.unlisted)

    now = time.time()
    objects, unlisted = _run(main, (url, "URL"))
    for info in objects:
        if as_json:
            click.echo(json.dumps({"name": info.name, "size": info.size, "mtime": info.mtime}))
        else:
            click.echo(f"{info.size:>12}  {(now - info.mtime) / 3600:8.1f}h  {printable_name(info.name)}")
    if _report_unlisted(unlisted):
        sys.exit(EXIT_FAILURES)


@click.command()
@click.argument("url")
@click.option("--prefix", default="")
@click.option("--namespace", help="Only this namespace.")
@click.option("--json", "as_json", is_flag=True)
def stat(url: str, prefix: str, namespace: str | None, as_json: bool) -> None:
    """Objects and bytes by namespace, model, codec and age (reads frame headers only)."""
    from kvstore.ops.inspect import stat_store

    async def main(b: Backend) -> Any:
        return await stat_store(b, prefix, namespace)

    st = _run(main, (url, "URL"))
    failed = bool(st.unlisted or st.unreadable)
    if as_json:
        click.echo(json.dumps(st.to_dict()))
        _report_unlisted(st.unlisted)
        if failed:
            sys.exit(EXIT_FAILURES)
        return
    click.echo(f"{st.url}: {st.objects} objects, {_human(st.bytes)}")
    for title, groups in (
        ("namespace", st.by_namespace),
        ("model", st.by_model),
        ("codec", st.by_codec),
        ("age", st.by_age),
    ):
        click.echo(f"  by {title}:")
        for key, g in sorted(groups.items(), key=lambda kv: -kv[1].bytes):
            click.echo(f"    {printable_name(key):<40} {g.objects:>9} objects {_human(g.bytes):>12}")
    if st.unreadable:
        click.echo(f"{st.unreadable} objects with unreadable frame headers (run kvstore verify)", err=True)
    if _report_unlisted(st.unlisted) or failed:
        sys.exit(EXIT_FAILURES)


@click.command()
@click.argument("url")
@click.option("--prefix", default="")
@click.option("--quarantine", is_flag=True, help="Move bad objects aside (disk) or delete them (others).")
@click.option("--concurrency", default=4, show_default=True, type=click.IntRange(min=1))
@click.option("--json", "as_json", is_flag=True)
def verify(url: str, prefix: str, quarantine: bool, concurrency: int, as_json: bool) -> None:
    """Read every object and check its frame (magic, header, length, checksum, key)."""
    from kvstore.ops.inspect import list_objects, verify_store

    async def main(b: Backend) -> Any:
        total = sum(o.size for o in await list_objects(b, prefix))
        with _bar(total, "verify", as_json) as bar:
            return await verify_store(
                b, prefix, quarantine=quarantine, concurrency=concurrency, progress=bar.update
            )

    report = _run(main, (url, "URL"))
    if as_json:
        click.echo(json.dumps(report.to_dict()))
    else:
        click.echo(
            f"checked {report.checked}: {report.ok} ok, {len(report.bad)} bad, {report.missing} vanished, "
            f"{len(report.unreadable)} unreadable, {len(report.foreign)} not kvstore objects"
        )
        for name, why in report.bad.items():
            click.echo(f"bad: {printable_name(name)}: {printable_name(why)}", err=True)
        for name in report.unreadable:
            click.echo(
                f"unreadable: {printable_name(name)}: still listed, but its read failed (see -v); rerun verify",
                err=True,
            )
        for name in report.foreign:
            click.echo(
                f"not a kvstore frame (a foreign object, or a kvstore one whose first bytes are damaged; "
                f"left as it is): {printable_name(name)}",
                err=True,
            )
        if report.quarantined:
            click.echo(f"quarantined {report.quarantined}")
        for name in report.not_quarantined:
            click.echo(
                f"not quarantined: {printable_name(name)}: written again since it was read, or it could not be "
                "moved (see the log); rerun verify",
                err=True,
            )
    if _report_unlisted(report.unlisted) or report.bad or report.unreadable or report.foreign:
        sys.exit(EXIT_FAILURES)


@click.command()
@click.argument("url")
@click.option("--older-than", help="Delete objects older than this (e.g. 7d, 12h).")
@click.option("--namespace", help="Only this namespace (its own budget with --max-bytes).")
@click.option("--prefix", default="")
@click.option("--max-bytes", help="Then delete oldest first until at most this many bytes remain.")
@click.option(
    "--stale-uploads",
    help="Abort unfinished multipart uploads (S3), and drop the parts of unfinished multi-part "
    "writes (Redis), started longer ago than this (default 1h, for Redis at least twice a put's deadline; "
    "a shorter value drops the parts of writes still under way).",
)
@click.option("--dry-run", is_flag=True)
@click.option("--json", "as_json", is_flag=True)
def gc(
    url: str,
    older_than: str | None,
    namespace: str | None,
    prefix: str,
    max_bytes: str | None,
    stale_uploads: str | None,
    dry_run: bool,
    as_json: bool,
) -> None:
    """Delete old objects and bring a store under a byte budget, oldest first; abort
    multipart uploads (S3) that were never finished."""
    from kvstore.ops.inspect import gc_store

    if older_than is None and max_bytes is None and stale_uploads is None:
        raise click.UsageError("say what to collect: --older-than, --max-bytes and/or --stale-uploads")
    try:
        age = parse_duration(older_than) if older_than else None
        budget = parse_size(max_bytes) if max_bytes is not None else None
        uploads_age = parse_duration(stale_uploads) if stale_uploads else None
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from exc
    if max_bytes is not None and not budget:
        # parse_size reads "", "0", "none" and "inf" as no limit, and a fraction of a byte
        # as 0: as a budget to keep, each would delete every object.
        raise click.BadParameter(
            f"--max-bytes {max_bytes!r} leaves no bytes to keep, so gc would delete every object: give "
            "the budget to keep, e.g. 100GiB (to delete everything on purpose: --older-than 0s)"
        )

    async def main(b: Backend) -> Any:
        return await gc_store(
            b,
            prefix=prefix,
            namespace=namespace,
            older_than_s=age,
            max_bytes=budget,
            stale_uploads_s=uploads_age,
            dry_run=dry_run,
        )

    report = _run(main, (url, "URL"))
    if as_json:
        click.echo(json.dumps(report.to_dict()))
    else:
        verb = "would delete" if dry_run else "deleted"
        click.echo(
            f"{verb} {len(report.deleted)} of {report.before_objects} objects "
            f"({_human(report.deleted_bytes)}); {_human(report.after_bytes)} remain"
            + (f"; {report.leftovers_removed} leftover parts removed" if report.leftovers_removed else "")
            + (
                f"; {report.uploads_aborted} unfinished uploads {'would be ' if dry_run else ''}aborted"
                if report.uploads_aborted
                else ""
            )
        )
    for name in report.not_deleted:
        click.echo(
            f"could not delete, or not known to be deleted (a fault; see -v); rerun gc: {printable_name(name)}",
            err=True,
        )
    for name in report.undated:
        click.echo(
            f"a damaged frame with no time to age it by, so --older-than leaves it (`kvstore verify --quarantine` "
            f"removes it): {printable_name(name)}",
            err=True,
        )
    for name in report.foreign:
        click.echo(f"not a kvstore frame, left as it is: {printable_name(name)}", err=True)
    for name in report.unreadable:
        click.echo(
            f"nothing of it could be read back, so its age is unknown; left (see -v; `kvstore verify` "
            f"tells a damaged one): {printable_name(name)}",
            err=True,
        )
    for name in report.uploads_not_aborted:
        click.echo(f"could not abort the unfinished upload of: {printable_name(name)}", err=True)
    if _report_unlisted(report.unlisted) or report.not_deleted or report.uploads_not_aborted:
        sys.exit(EXIT_FAILURES)
