"""LMCache's own L2-adapter conformance check, run as LMCache ships it.

Owns: `assert_l2_conformance(spec, cwd, env)`: ``python -m lmcache.v1.basic_check --mode
test_l2_adapter --l2-adapter JSON`` (``lmcache.inprocess.v1.basic_check`` from LMCache 0.5.7) in a subprocess (the checker prints its verdicts and
exits 0 either way, so the verdicts are read) with kvstore's repository on PYTHONPATH.
Must not touch: the adapter under test.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

from kvstore.lmcache_paths import INPROCESS

ROOT = Path(__file__).resolve().parents[2]


def assert_l2_conformance(spec: Mapping[str, object], cwd: Path, env: Mapping[str, str] | None = None) -> str:
    """Run the check on the adapter `spec` (its ``--l2-adapter`` JSON); assert every phase
    passed (5 of 5 absent, stored, found, loaded, equal); return what it printed.

    `env` replaces the environment (LMCACHE_* and KVSTORE_* are dropped by default);
    `cwd` must not be inside ``lmcache/v1`` (its ``platform`` package would shadow the
    standard library's)."""
    if env is None:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("LMCACHE_", "KVSTORE_"))}
    run_env = dict(env)
    run_env["PYTHONPATH"] = f"{ROOT}{os.pathsep}{run_env.get('PYTHONPATH', '')}"
    cmd = [sys.executable, "-m", f"{INPROCESS}.basic_check", "--mode", "test_l2_adapter"]
    proc = subprocess.run(
        [*cmd, "--l2-adapter", json.dumps(spec)],
        cwd=cwd,
        env=run_env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    out = proc.stdout
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Test Failed" not in out, out
    assert "5/5 correctly absent" in out and "5/5 found" in out, out
    assert "Validation (loaded): 5/5" in out and "Validation (content): 5/5" in out, out
    return out


__all__ = ["assert_l2_conformance"]
