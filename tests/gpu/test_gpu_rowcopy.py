"""The one-launch row copy: word choice, the host loop, the Triton kernel (interpreted
on CPU when Triton is installed; compiled on CUDA, device and pinned host memory)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from kvstore.gpu.rowcopy import copy_rows, word_bytes


def test_word_is_the_widest_that_divides_rows_and_addresses():
    assert word_bytes(2048, [4096, 8192]) == 8
    assert word_bytes(12, [4096]) == 4
    assert word_bytes(2048, [4096, 8194]) == 2
    assert word_bytes(3, [4096]) == 1


def _rows(n: int, row_bytes: int):
    gen = torch.Generator().manual_seed(n + row_bytes)
    src = torch.randint(0, 256, (n, row_bytes), dtype=torch.uint8, generator=gen)
    return src, torch.zeros_like(src), torch.randperm(n, generator=gen)


def test_host_loop_copies_rows_by_address():
    src, dst, perm = _rows(37, 24)
    copy_rows(src.data_ptr() + perm * 24, dst.data_ptr() + torch.arange(37) * 24, 24, 8)
    assert torch.equal(dst, src[perm])
    with pytest.raises(ValueError, match="1-D and alike"):
        copy_rows(torch.zeros(3, dtype=torch.int64), torch.zeros(4, dtype=torch.int64), 24, 8)
    with pytest.raises(ValueError, match="whole number of 8-byte words"):
        copy_rows(torch.zeros(3, dtype=torch.int64), torch.zeros(3, dtype=torch.int64), 12, 8)


TRITON = dict(
    available=importlib.util.find_spec("triton") is not None,
    what="Triton (its CPU interpreter runs the row-copy kernels)",
    install="bash scripts/setup.sh --test",
)


@pytest.mark.needs(**TRITON)
def test_triton_kernel_under_the_interpreter():
    """The kernel itself, run by Triton's CPU interpreter on host addresses (every word size)."""
    code = textwrap.dedent(
        """
        import torch
        from kvstore.gpu.rowcopy import _kernel
        for word, row_bytes in ((8, 2048), (4, 12), (2, 6), (1, 3), (8, 8 * 1500)):
            src = torch.randint(0, 256, (16, row_bytes), dtype=torch.uint8)
            dst = torch.zeros(16, row_bytes, dtype=torch.uint8)
            perm = torch.randperm(16)
            words = row_bytes // word
            block = min(1024, 1 << max(0, (words - 1).bit_length()))
            _kernel()[(16,)](src.data_ptr() + perm * row_bytes, dst.data_ptr() + torch.arange(16) * row_bytes,
                             ROW_WORDS=words, BLOCK=block, WORD=word)
            assert torch.equal(dst, src[perm]), (word, row_bytes)
        print("ok")
        """
    )
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]


@pytest.mark.gpu
@pytest.mark.parametrize("where", ["device", "pinned-to-device", "device-to-pinned"])
def test_cuda_kernel_between_device_and_pinned_memory(where):
    n, row_bytes = 4099, 2048 + 16
    src, dst, perm = _rows(n, row_bytes)
    src_t = src.cuda() if where in ("device", "device-to-pinned") else src.pin_memory()
    dst_t = dst.cuda() if where in ("device", "pinned-to-device") else dst.pin_memory()
    s = (src_t.data_ptr() + perm * row_bytes).cuda()
    d = (dst_t.data_ptr() + torch.arange(n) * row_bytes).cuda()
    copy_rows(s, d, row_bytes, word_bytes(row_bytes, [src_t.data_ptr(), dst_t.data_ptr()]))
    torch.cuda.synchronize()
    assert torch.equal(dst_t.cpu(), src[perm])


@pytest.mark.needs(**TRITON)
def test_fused_kernel_moves_connector_transfers_under_the_interpreter():
    """The kernel that computes each row's addresses itself, run by Triton's interpreter
    on host tensors: every layout, whole chunks and layerwise, vLLM's cached prefix, a
    partial chunk (the connector tests of the row-copy path, in a child process)."""
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
