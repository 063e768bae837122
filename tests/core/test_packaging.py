"""The distribution's import names: `kvstore`, `kvstore_lmcache` (the folder plugins/), and
the old `plugins.*` module paths as aliases that never shadow another project's package."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _declared() -> list[str]:
    import tomllib

    with open(ROOT / "pyproject.toml", "rb") as f:
        return tomllib.load(f)["tool"]["setuptools"]["packages"]


@pytest.mark.skipif(sys.version_info < (3, 11), reason="tomllib")
def test_every_kvstore_package_is_in_the_distribution() -> None:
    found = sorted(
        ".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "kvstore").rglob("__init__.py")
    )
    assert set(found) | {"kvstore_lmcache", "plugins"} == set(_declared())


def _python(code: str, cwd: Path) -> str:
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True, timeout=120, check=False
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.strip()


@pytest.mark.parametrize("where", ["outside", "checkout"])
def test_old_module_paths_are_the_same_modules(where: str, tmp_path: Path) -> None:
    """An existing config naming `plugins.l2_adapter` gets kvstore_lmcache's class itself,
    both from an installed distribution and from a checkout on sys.path."""
    code = (
        "import importlib\n"
        "for m in ('l2_adapter', 'storage_plugin', 'remote_connector', 'mp_serde', 'keymap'):\n"
        "    old = importlib.import_module('plugins.' + m)\n"
        "    new = importlib.import_module('kvstore_lmcache.' + m)\n"
        "    assert old is new, (m, old, new)\n"
        "import plugins.l2_adapter as a, kvstore_lmcache.l2_adapter as b\n"
        "assert a.KVStoreL2Adapter is b.KVStoreL2Adapter\n"
        "print('ok')\n"
    )
    assert _python(code, tmp_path if where == "outside" else ROOT) == "ok"


def test_old_names_do_not_shadow_another_plugins_package(tmp_path: Path) -> None:
    """Another project's regular `plugins` package wins over kvstore's namespace of aliases,
    and kvstore_lmcache still imports beside it."""
    other = tmp_path / "site" / "plugins"
    other.mkdir(parents=True)
    (other / "__init__.py").write_text("OWNER = 'someone else'\n")
    code = (
        "import sys; sys.path.insert(0, {!r})\n"
        "import plugins, kvstore_lmcache.l2_adapter\n"
        "print(plugins.OWNER)\n"
    ).format(str(tmp_path / "site"))
    assert _python(code, tmp_path) == "someone else"


def test_old_mp_serde_entry_point_runs(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "plugins.mp_serde", "verify", "--help"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert out.returncode == 0 and "verify" in out.stdout, out.stderr[-2000:]
