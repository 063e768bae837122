"""Helpers for tests of the disk tier: what a store directory really holds."""

from __future__ import annotations

import os
from pathlib import Path


def on_disk(root: Path) -> int:
    """Bytes of every file under ``root/objects``, temp files of writes in flight included."""
    total = 0
    for dirpath, _, files in os.walk(root / "objects"):
        for f in files:
            try:
                total += os.stat(os.path.join(dirpath, f)).st_size
            except FileNotFoundError:
                pass
    return total
