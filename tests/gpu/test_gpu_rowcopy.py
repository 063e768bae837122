"""The one-launch row copy: word choice, and the Triton kernel itself run by Triton's CPU
interpreter (the host loop and the CUDA runs are the connector tests' row-copy path)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

from kvstore.gpu.rowcopy import word_bytes


def test_word_is_the_widest_that_divides_rows_and_addresses():
    assert word_bytes(2048, [4096, 8192]) == 8
    assert word_bytes(12, [4096]) == 4
    assert word_bytes(2048, [4096, 8194]) == 2
    assert word_bytes(3, [4096]) == 1


TRITON = dict(
    available=importlib.util.find_spec("triton") is not None,
    what="Triton (its CPU interpreter runs the row-copy kernel)",
    install="bash scripts/setup.sh --test",
)


@pytest.mark.needs(**TRITON)
def test_fused_kernel_moves_connector_transfers_under_the_interpreter():
    """The kernel that computes each row's addresses itself, run by Triton's interpreter
    on host tensors: every layout, whole chunks and layerwise, vLLM's cached prefix, a
    partial chunk, every word size (the connector tests of the row-copy path, in a child
    process; they check the kernel, not the host loop, ran)."""
    here = os.path.dirname(__file__)
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-k",
            "rowcopy",
            "-m",
            "not gpu",  # the interpreter runs kernels on the host: host tensors only
            os.path.join(here, "test_gpu_connector.py"),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:]
    assert " passed" in done.stdout and " failed" not in done.stdout
