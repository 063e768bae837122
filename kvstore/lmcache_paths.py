"""Where the installed LMCache keeps the in-process classes kvstore builds on.

LMCache 0.5.7 moved its in-process engine (``cache_engine``, ``gpu_connector``,
``basic_check`` …) from ``lmcache.v1`` to ``lmcache.inprocess.v1``; what both modes
share (``memory_management``, ``config``, ``storage_backend``, the MP server under
``lmcache.v1.multiprocess`` and ``lmcache.v1.distributed``) stayed where it was.

Owns: `INPROCESS` (the package prefix of the installed LMCache) and `inprocess_module`.
Must not touch: anything else of LMCache (kvstore's integration lives in
``kvstore_lmcache``); importing this module does not import LMCache's engine.
"""

from __future__ import annotations

import importlib
import importlib.util
from types import ModuleType


def _inprocess_prefix() -> str:
    try:
        moved = importlib.util.find_spec("lmcache.inprocess") is not None
    except ModuleNotFoundError as exc:
        if exc.name != "lmcache":  # lmcache is there but fails to import: say why
            raise
        moved = False  # no lmcache at all: the old spelling, for messages
    return "lmcache.inprocess.v1" if moved else "lmcache.v1"


INPROCESS = _inprocess_prefix()
"""``lmcache.inprocess.v1`` (LMCache 0.5.7 and later) or ``lmcache.v1`` (0.5.6 and earlier)."""


def inprocess_module(name: str) -> ModuleType:
    """The in-process module ``name`` (e.g. ``"cache_engine"``) of the installed LMCache."""
    return importlib.import_module(f"{INPROCESS}.{name}")


__all__ = ["INPROCESS", "inprocess_module"]
