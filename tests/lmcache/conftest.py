"""Fixtures: LMCache engines on CPU, configured only through LMCACHE_* variables."""

from __future__ import annotations

import os
import uuid

import pytest
import torch

from tests.lmcache.helpers import HEAD_DIM, HEADS, LAYERS, lmcache_env


@pytest.fixture
def make_engine(monkeypatch):
    """make_engine(path, asyncm, tiers=None) -> CPUEngine; closed at teardown."""
    from kvstore.demo.cpu_engine import build_cpu_engine

    built = []

    def make(path: str, asyncm: bool, tiers: list | None = None, extra: dict | None = None):
        for name in list(os.environ):
            if name.startswith(("LMCACHE_", "KVSTORE_")) and name != "KVSTORE_HOME":
                monkeypatch.delenv(name)
        tiers = tiers or [f"mem://t-{uuid.uuid4().hex[:8]}"]
        for k, v in lmcache_env(path, asyncm, tiers, extra).items():
            monkeypatch.setenv(k, v)
        eng = build_cpu_engine(
            model_name="tiny-test",
            num_layers=LAYERS,
            num_kv_heads=HEADS,
            head_dim=HEAD_DIM,
            dtype=torch.bfloat16,
        )
        built.append(eng)
        return eng

    yield make
    for eng in built:
        eng.close()
