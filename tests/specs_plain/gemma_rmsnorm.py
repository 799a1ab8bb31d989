"""Gemma's RMSNorm: the weight scales by (1 + w), so that w = 0 is the identity; then a linear."""
import numpy as np

from datamove.dataflow.spec import Tensor, dims

B, T, D, F = dims(B=3, T=5, D=7, F=6)
INDEX = {"b": B, "t": T, "d": D, "f": F}


def gemma_rmsnorm(x: Tensor("btd"), g: Tensor("d"), w: Tensor("df")):
    normed = x * (1.0 / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + 1e-6))
    return (normed * (1.0 + g)) @ w
