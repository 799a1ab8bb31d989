"""Triton side of the dropout convention in ``dataflow.dropout_mask``.

A kernel passes the logical row-major index of each element (over the tensor's named dims in
spec order, independent of the storage layout) and gets the same keep decision that
``dataflow.dropout_mask.keep_mask`` computes in NumPy.
"""
import triton
import triton.language as tl


@triton.jit
def dropout_keep(seed, offset, logical_index, p):
    """Boolean block: True where the element at ``logical_index`` (int32/int64 block) survives."""
    return tl.rand(seed, offset + logical_index) > p
