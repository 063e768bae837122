"""`kvstore bench`: the fixed --json contract, on a disk tier and the memory tier."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from kvstore.cli.main import cli

KEYS = {"put_mib_s", "get_mib_s", "baseline_put_mib_s", "baseline_get_mib_s", "put_ratio", "get_ratio"}


@pytest.mark.parametrize("through", ["tier", "backend"])
def test_bench_json_contract_on_disk(tmp_path: Path, through: str) -> None:
    res = CliRunner().invoke(
        cli,
        [
            "bench",
            (tmp_path / "b").as_uri(),
            "--size",
            "1MiB",
            "--count",
            "4",
            "--rounds",
            "1",
            "--through",
            through,
            "--json",
        ],
    )
    assert res.exit_code == 0, res.output
    out = json.loads(res.output)
    assert set(out) >= KEYS
    assert all(out[k] > 0 for k in KEYS)
    assert out["through"] == through and out["shape"] == [2, 32, 8, 1024]
    assert not any(p.is_file() for p in (tmp_path / "b").rglob("*"))  # cleans up after itself


def test_bench_memory_and_default_home() -> None:
    res = CliRunner().invoke(
        cli, ["bench", "mem://bench", "--size", "256KiB", "--count", "2", "--rounds", "1", "--json"]
    )
    assert res.exit_code == 0, res.output
    assert json.loads(res.output)["get_ratio"] > 0
    res = CliRunner().invoke(cli, ["bench", "--size", "3", "--count", "1"])
    assert res.exit_code != 0 and "even" in res.output
