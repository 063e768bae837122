"""Bad settings are errors that name the setting, never a hang or a silent default."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from kvstore.backends import open_backend
from kvstore.backends.disk import DiskBackend
from kvstore.ops.migrate import MigrateOptions
from tests.support.required import require_module


@pytest.mark.parametrize(
    ("query", "option"),
    [
        ("concurrency=0", "concurrency"),
        ("concurrency=-2", "concurrency"),
        ("concurrency=many", "concurrency"),
        ("capacity=-1", "capacity"),
        ("capacity=0", "capacity"),
    ],
)
def test_bad_file_options_name_the_option(tmp_path: Path, query: str, option: str) -> None:
    with pytest.raises(ValueError, match=rf"\b{option}\b"):
        open_backend(f"{(tmp_path / 's').as_uri()}?{query}")


def test_disk_backend_refuses_zero_concurrency(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="concurrency"):
        DiskBackend(tmp_path, concurrency=0)  # an asyncio.Semaphore(0) would wait forever


def test_bad_mem_capacity_names_the_option() -> None:
    with pytest.raises(ValueError, match="capacity"):
        open_backend("mem://bad-capacity?capacity=-5")


@pytest.mark.parametrize(
    ("query", "option"),
    [
        ("timeout=abc", "timeout"),
        ("timeout=0", "timeout"),
        ("connect_timeout=-1", "connect_timeout"),
        ("inflight=0", "inflight"),
        ("max_connections=x", "max_connections"),
        ("ttl=-3", "ttl"),
        ("ttl.tenant=soon", "ttl.tenant"),
        ("part_size=0", "part_size"),
    ],
)
def test_bad_redis_options_name_the_option(query: str, option: str) -> None:
    require_module("redis")
    from kvstore.backends.redis import parse_options

    with pytest.raises(ValueError, match=rf"{option}="):
        parse_options(dict([query.split("=", 1)]))


@pytest.mark.parametrize(("query", "option"), [("timeout=abc", "timeout"), ("concurrency=0", "concurrency")])
def test_bad_s3_options_name_the_option(query: str, option: str) -> None:
    require_module("aioboto3")
    with pytest.raises(ValueError, match=option):
        open_backend(f"s3://bucket/p?{query}")


@pytest.mark.parametrize("value", ["0", "-1", -1, 0, "lots"])
def test_bad_max_pending_names_the_option(value: object) -> None:
    from kvstore.store_config import StoreConfig, StoreConfigError

    with pytest.raises(StoreConfigError, match="max_pending"):
        StoreConfig.from_mapping({"kvstore.max_pending": value})


def test_max_pending_none_is_unbounded_and_sizes_read() -> None:
    from kvstore.store_config import StoreConfig

    assert StoreConfig.from_mapping({"kvstore.max_pending": "none"}).max_pending is None
    assert StoreConfig.from_mapping({"kvstore.max_pending": "64MiB"}).max_pending == 64 << 20


@pytest.mark.parametrize("value", ["abc", "0", "-2"])
def test_bad_timeout_names_the_option(value: str) -> None:
    from kvstore.store_config import StoreConfig, StoreConfigError

    with pytest.raises(StoreConfigError, match="timeout_s"):
        StoreConfig.from_mapping({"kvstore.timeout_s": value})


def test_migrate_options_refuse_zero_concurrency_and_budget() -> None:
    with pytest.raises(ValueError, match="concurrency"):
        MigrateOptions(concurrency=0)
    with pytest.raises(ValueError, match="max_inflight_bytes"):
        MigrateOptions(max_inflight_bytes=0)


@pytest.mark.parametrize(
    ("args", "option"),
    [
        (["migrate", "mem://a", "mem://b", "--concurrency", "0"], "--concurrency"),
        (["migrate", "mem://a", "mem://b", "--max-inflight", "0"], "--max-inflight"),
        (["migrate", "mem://a", "mem://b", "--max-inflight", "-1MiB"], "--max-inflight"),
        (["verify", "mem://a", "--concurrency", "-1"], "--concurrency"),
    ],
)
def test_cli_bad_options_are_usage_errors(args: list[str], option: str) -> None:
    from kvstore.cli.main import cli

    res = CliRunner().invoke(cli, args)
    assert res.exit_code == 2 and option in res.output, res.output
