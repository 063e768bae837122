"""LMCache's own checker, ``python -m lmcache.v1.basic_check``, run against kvstore.

``--mode test_storage_manager`` builds a StorageManager from the LMCACHE_* config (our
storage plugin is loaded from it); ``--mode test_remote`` builds a RemoteBackend on
``remote_url`` (``plugin://kvstore`` selects our connector).  The checker prints its
verdicts and always exits 0, so the test reads them.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from kvstore.lmcache_paths import INPROCESS
from tests.lmcache.helpers import PLUGIN_EXTRA, REMOTE_EXTRA

ROOT = Path(__file__).resolve().parents[2]


def _run(mode: str, env_extra: dict[str, str], tmp_path: Path) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LMCACHE_", "KVSTORE_"))}
    env.update(env_extra)
    env["PYTHONPATH"] = f"{ROOT}{os.pathsep}{env.get('PYTHONPATH', '')}"
    proc = subprocess.run(
        [sys.executable, "-m", f"{INPROCESS}.basic_check", "--mode", mode, "--num-keys", "5"],
        cwd=tmp_path,  # not inside lmcache/v1: its platform/ package would shadow the stdlib's
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def _assert_all_passed(out: str) -> None:
    verdicts = re.findall(r"Validation.*?: (\d+)/(\d+) passed", out)
    assert len(verdicts) == 5, out  # exists(miss), put, exists(hit), get not-None, get content
    assert all(a == b == "5" for a, b in verdicts), out
    assert "Test Failed" not in out, out


@pytest.mark.parametrize("path", ["plugin", "remote"])
def test_basic_check_passes(path, tmp_path):
    base = {"LMCACHE_LOCAL_CPU": "False", "LMCACHE_MAX_LOCAL_CPU_SIZE": "0.1"}
    tiers = {"kvstore.tiers": [f"mem://basic-check-{path}"]}
    if path == "plugin":
        mode = "test_storage_manager"
        env = {**base, "LMCACHE_STORAGE_PLUGINS": "kvstore"}
        env["LMCACHE_EXTRA_CONFIG"] = json.dumps({**PLUGIN_EXTRA, **tiers})
    else:
        mode = "test_remote"
        env = {
            **base,
            "LMCACHE_REMOTE_STORAGE_PLUGINS": "kvstore",
            "LMCACHE_REMOTE_URL": "plugin://kvstore",
            "LMCACHE_REMOTE_SERDE": "naive",
        }
        env["LMCACHE_EXTRA_CONFIG"] = json.dumps({**REMOTE_EXTRA, **tiers})
    _assert_all_passed(_run(mode, env, tmp_path))
