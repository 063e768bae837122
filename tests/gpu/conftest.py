"""kvstore.gpu tests: CPU by default; tests marked ``gpu`` need CUDA and skip without it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from gpu_kvgen import LAYOUTS


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    here = Path(__file__).parent
    for item in items:
        if item.get_closest_marker("gpu") is not None and here in Path(str(item.fspath)).parents:
            item.add_marker(skip)


@pytest.fixture(params=LAYOUTS)
def layout(request) -> str:
    return request.param
