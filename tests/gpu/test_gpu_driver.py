"""kvstore.gpu.driver: what a failed driver call raises, and that a machine without a CUDA
driver gets no driver calls (the connector then keeps torch's copies). The copies
themselves run on CUDA in test_gpu_pipeline.py and test_gpu_connector.py."""

from __future__ import annotations

import enum

import pytest
import torch

from kvstore.gpu.driver import DriverCalls, DriverError, driver_calls


class _Result(enum.IntEnum):
    CUDA_SUCCESS = 0
    CUDA_ERROR_INVALID_VALUE = 1


class _Driver:
    """Answers as cuda.bindings.driver does: a tuple whose first item is the result."""

    def cuMemcpyAsync(self, *args):  # the driver's names
        self.calls.append(("copy", *args))
        return (self.result,)

    def cuEventRecord(self, *args):
        self.calls.append(("record", *args))
        return (self.result,)

    def cuStreamWaitEvent(self, *args):
        self.calls.append(("wait", *args))
        return (self.result,)

    def __init__(self, result: _Result, context: object = 0, device: int = 0) -> None:
        self.result, self.context, self.device = result, context, device
        self.calls: list[tuple] = []

    def cuCtxGetCurrent(self):
        return self.result, self.context

    def cuCtxGetDevice(self):
        return self.result, self.device


def test_calls_pass_addresses_and_handles_through():
    drv = _Driver(_Result.CUDA_SUCCESS)
    calls = DriverCalls(drv)
    calls.copy(0x1000, 0x2000, 4096, 7)
    calls.record(11, 7)
    calls.wait(7, 11)
    assert drv.calls == [("copy", 0x1000, 0x2000, 4096, 7), ("record", 11, 7), ("wait", 7, 11, 0)]


def test_driver_calls_only_for_the_device_whose_context_is_current(monkeypatch):
    """A thread with no current context (a null handle, as cuda.bindings gives it: its
    wrapper's getPtr() is not the handle) or another device's gets none."""
    from cuda.bindings import driver as cuda_driver

    import kvstore.gpu.driver as mod

    cases = [
        (_Driver(_Result.CUDA_SUCCESS, context=cuda_driver.CUcontext(0)), None),
        (_Driver(_Result.CUDA_SUCCESS, context=cuda_driver.CUcontext(0x1234), device=1), None),
        (_Driver(_Result.CUDA_ERROR_INVALID_VALUE, context=cuda_driver.CUcontext(0x1234)), None),
        (_Driver(_Result.CUDA_SUCCESS, context=cuda_driver.CUcontext(0x1234), device=0), "calls"),
    ]
    for fake, want in cases:
        monkeypatch.setattr(mod, "_bindings", lambda fake=fake: fake)
        got = driver_calls(0)
        assert (got is not None) == (want == "calls"), fake.__dict__


@pytest.mark.parametrize(
    ("call", "name"),
    [
        (lambda c: c.copy(1, 2, 3, 4), "cuMemcpyAsync"),
        (lambda c: c.record(1, 2), "cuEventRecord"),
        (lambda c: c.wait(1, 2), "cuStreamWaitEvent"),
    ],
)
def test_a_failed_call_names_itself_and_the_error(call, name):
    with pytest.raises(DriverError, match=f"{name} failed: CUDA_ERROR_INVALID_VALUE"):
        call(DriverCalls(_Driver(_Result.CUDA_ERROR_INVALID_VALUE)))


@pytest.mark.skipif(torch.cuda.is_available(), reason="a machine without a CUDA driver")
def test_no_driver_calls_without_a_cuda_driver():
    assert driver_calls(0) is None
