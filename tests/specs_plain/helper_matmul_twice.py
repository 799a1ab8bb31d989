"""A helper containing @ called twice (the gate and up projections of SwiGLU), and one whose
result is the einsum itself: once both calls' einsums shared one output name in DaCe's inlining."""
import numpy as np

from datamove.dataflow.spec import Tensor, dims

B, T, D, F = dims(B=2, T=5, D=7, F=9)
INDEX = {"b": B, "t": T, "d": D, "f": F}


def silu_linear(x, w):
    y = x @ w
    return y / (1 + np.exp(-y))


def linear(x, w):
    return x @ w


def helper_matmul_twice(x: Tensor("btd"), w1: Tensor("df"), w2: Tensor("df"), w3: Tensor("fd")):
    a = silu_linear(x, w1)
    b = silu_linear(x, w2)
    return linear(a * b, w3) + linear(x @ w1, w3)
