"""`prefetch(array, i, j, k, l)`: a hint to start loading `array[i, j, k, l]`'s cache line, for numba loops.

Decode attention reads each sequence's pages once, from memory rather than the caches (30 layers of KV
pages do not fit in them). The hardware's prefetcher follows a page's rows but loses the stream at every
jump to the next page, so the kernel alternates between waiting for memory and computing. Prefetching
the next page's rows while computing on this one overlaps the two (docs/performance.md#paged-attention-kernels).
numba has no prefetch of its own; this is LLVM's `llvm.prefetch` intrinsic (read, highest locality).
"""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic


@intrinsic
def prefetch(typingctx, array, i, j, k, l):  # noqa: E741
    """Prefetch the cache line holding `array[i, j, k, l]` (a 4-D array; no bounds check: stay inside)."""
    def codegen(context, builder, signature, args):
        array_type = signature.args[0]
        view = context.make_array(array_type)(context, builder, args[0])
        indices = [context.cast(builder, value, kind, types.intp) for value, kind in zip(args[1:], signature.args[1:])]
        pointer = cgutils.get_item_pointer(context, builder, array_type, view, indices)
        byte_pointer = ir.IntType(8).as_pointer()
        i32 = ir.IntType(32)
        declaration = ir.FunctionType(ir.VoidType(), [byte_pointer, i32, i32, i32])
        function = cgutils.get_or_insert_function(builder.module, declaration, "llvm.prefetch.p0i8")
        # read (0), highest temporal locality (3), data cache (1)
        builder.call(function, [builder.bitcast(pointer, byte_pointer), i32(0), i32(3), i32(1)])
        return context.get_dummy_value()

    return types.void(array, i, j, k, l), codegen
