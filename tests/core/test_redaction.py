"""Secrets in URLs never leave: errors, logs, tier names, reports all show them redacted."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from click.testing import CliRunner

from kvstore.backends import open_backend
from kvstore.redact import redact_text, redact_url
from tests.support.required import require_module

SECRETS = ("SEKRIT1", "SEKRIT2", "SEKRIT3", "SEKRIT4")


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        (
            "s3://b/p?endpoint_url=http://h:9000&secret_key=SEKRIT1&region=x",
            "s3://b/p?endpoint_url=http://h:9000&secret_key=***&region=x",
        ),
        ("s3://b/p?aws_secret_access_key=SEKRIT1&aws_session_token=SEKRIT2", None),
        ("redis://user:SEKRIT1@h:6379/0?password=SEKRIT2", "redis://user:***@h:6379/0?password=***"),
        ("rediss://:SEKRIT1@h:6380", "rediss://:***@h:6380"),
        ("redis://SEKRIT1@h", "redis://***@h"),  # a lone userinfo is a token
        ("s3://AKIA:SEKRIT1@bucket/x?token=SEKRIT2", "s3://AKIA:***@bucket/x?token=***"),
        ("redis+cluster://u:SEKRIT1@h1:1,h2:2", "redis+cluster://u:***@h1:1,h2:2"),
        ("redis://u:SEKRIT1@[::1", None),  # unparseable: redacted by pattern, no exception
        ("file:///tmp/x?capacity=1GiB&fsync=false", "file:///tmp/x?capacity=1GiB&fsync=false"),
    ],
)
def test_redact_url(url: str, shown: str | None) -> None:
    out = redact_url(url)
    assert not any(s in out for s in SECRETS), out
    if shown is not None:
        assert out == shown


def test_redact_text_finds_urls_and_pairs() -> None:
    msg = (
        "bad 's3://b?secret_key=SEKRIT1' and aws_secret_access_key=SEKRIT2, password: SEKRIT3 token='SEKRIT4'"
    )
    out = redact_text(msg)
    assert not any(s in out for s in SECRETS) and "secret_key=***" in out


@pytest.mark.parametrize(
    "url",
    [
        "s3://bucket/p?secret_key=SEKRIT1",  # unknown option: the error lists the URL
        "s3://bucket/p?aws_secret_access_key=SEKRIT1&timeout=abc",
        "s3://AKIA:SEKRIT1@bucket/p?timeout=-1",
        "file:///tmp/x?password=SEKRIT1",
        "redis://u:SEKRIT1@h:1/0?nonsense=1",
        "nosuch://u:SEKRIT1@h?token=SEKRIT2",
        "u:SEKRIT1@h?token=SEKRIT2",
    ],
)
def test_open_errors_do_not_echo_secrets(url: str) -> None:
    require_module("aioboto3")
    require_module("redis")
    with pytest.raises(ValueError) as err:
        open_backend(url)
    assert not any(s in str(err.value) for s in SECRETS), str(err.value)


@pytest.mark.parametrize(
    "args",
    [
        ["ls", "s3://bucket/p?secret_key=SEKRIT1"],
        ["stat", "redis://u:SEKRIT1@h:1/0?nonsense=1"],
        ["migrate", "mem://a", "s3://b/p?aws_secret_access_key=SEKRIT1"],
        ["verify", "redis://u:SEKRIT1@127.0.0.1:1/0?connect_timeout=0.2&timeout=0.2"],  # unreachable
    ],
)
def test_cli_errors_do_not_echo_secrets(args: list[str]) -> None:
    from kvstore.cli.main import cli

    res = CliRunner().invoke(cli, args)
    assert res.exit_code != 0
    text = res.output + (
        repr(res.exception) if res.exception and not isinstance(res.exception, SystemExit) else ""
    )
    assert not any(s in text for s in SECRETS), text


def test_tier_name_store_config_and_reports_are_redacted(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from kvstore.store_config import TierConfig
    from kvstore.tier import Tier

    url = "mem://redact?capacity=1MiB"
    tier = Tier(open_backend(url))
    tier.backend.url = "mem://redact?capacity=1MiB&token=SEKRIT1"  # as if given with a secret
    assert "SEKRIT1" not in Tier(tier.backend).name
    assert "SEKRIT1" not in tier.backend.stats().url
    cfg = TierConfig("s3://b/p?endpoint_url=http://h&secret_key=SEKRIT1")
    assert "SEKRIT1" not in cfg.redacted()
    with caplog.at_level(logging.WARNING):
        import asyncio

        async def go() -> None:
            t = Tier(tier.backend)
            await t.backend.put("ns/x", b"not a frame")
            assert await t.get_many(["ns/x"]) == [None]

        asyncio.run(go())
    assert "quarantined" in caplog.text and "SEKRIT1" not in caplog.text


async def test_names_in_logs_cannot_forge_log_lines(caplog: pytest.LogCaptureFixture) -> None:
    from kvstore.tier import Tier

    tier = Tier.open("mem://log-names")
    name = "ns/x\nERROR forged line\x1b[2J"
    await tier.backend.put(name, b"not a frame")
    with caplog.at_level(logging.WARNING):
        assert await tier.get_many([name]) == [None]
    assert caplog.records and all(
        "\n" not in r.getMessage() and "\x1b" not in r.getMessage() for r in caplog.records
    )
