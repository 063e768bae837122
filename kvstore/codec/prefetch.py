"""A software prefetch for numba kernels: `prefetch(arr, i)` asks the CPU to bring the
cache line holding ``arr[i]`` (a C-contiguous 1-D array, ``i`` unchecked) into L1.

Owns: one numba intrinsic around LLVM's ``llvm.prefetch`` (read, high locality, data
cache).  It is a hint: it never faults, reads nothing into the program, and is used where
a kernel knows which table it needs next before the loads that need it are issued.
"""

from __future__ import annotations

from typing import Any

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic


@intrinsic
def prefetch(typingctx: Any, arr: Any, idx: Any) -> Any:
    if not (isinstance(arr, types.Array) and arr.ndim == 1 and isinstance(idx, types.Integer)):
        return None

    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        aryty = sig.args[0]
        ary = context.make_array(aryty)(context, builder, args[0])
        ptr = cgutils.get_item_pointer(
            context, builder, aryty, ary, [args[1]], wraparound=False, boundscheck=False
        )
        i8p = ir.IntType(8).as_pointer()
        i32 = ir.IntType(32)
        fnty = ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32])
        fn = cgutils.get_or_insert_function(builder.module, fnty, "llvm.prefetch.p0")
        # (address, read = 0, locality = 3: keep in every level, cache type = 1: data)
        builder.call(fn, [builder.bitcast(ptr, i8p), i32(0), i32(3), i32(1)])
        return context.get_dummy_value()

    return types.void(arr, idx), codegen
