"""A second process finds what the first stored in kvstore's disk tier.

LMCache's own LocalDiskBackend keeps its index in memory, so a new process finds
nothing on the same directory; the last test shows that baseline on the same workload.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.lmcache.helpers import CHUNK, lmcache_env

ROOT = Path(__file__).resolve().parents[2]


def _run(role: str, env_extra: dict[str, str]) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LMCACHE_", "KVSTORE_"))}
    env.update(env_extra)
    env["PYTHONHASHSEED"] = "0"  # LMCache hashes chunks with Python's hash() when vLLM is absent
    env["LMCACHE_LOG_LEVEL"] = "WARNING"
    env["PYTHONPATH"] = f"{ROOT}{os.pathsep}{env.get('PYTHONPATH', '')}"
    proc = subprocess.run(
        [sys.executable, "-m", "tests.lmcache.two_process_worker", role],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize(
    ("path", "asyncm"), [("plugin", False), ("remote", True)], ids=["plugin-sync", "remote-async"]
)
def test_second_process_finds_the_first_ones_chunks(tmp_path, path, asyncm):
    env = lmcache_env(path, asyncm, ["mem://hot?capacity=64MiB", f"file://{tmp_path / 'warm'}?fsync=false"])
    assert _run("write", env) == {"stored": True}
    assert _run("read", env) == {"hit": 4 * CHUNK, "got": 4 * CHUNK, "equal": True}


def test_lmcache_local_disk_alone_does_not(tmp_path):
    env = {
        "LMCACHE_CHUNK_SIZE": str(CHUNK),
        "LMCACHE_LOCAL_CPU": "False",
        "LMCACHE_MAX_LOCAL_CPU_SIZE": "0.05",
        "LMCACHE_LOCAL_DISK": f"file://{tmp_path / 'lmcache-disk'}/",
        "LMCACHE_MAX_LOCAL_DISK_SIZE": "0.1",
    }
    assert _run("write", env) == {"stored": True}
    assert any((tmp_path / "lmcache-disk").iterdir()), "LMCache wrote its files..."
    assert _run("read", env)["hit"] == 0, "...but a new process does not find them"
