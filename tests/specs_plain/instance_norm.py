"""Normalisation over two axes: a tuple of negative axes, then of positive ones."""
import numpy as np

from datamove.dataflow.spec import Tensor, dims

B, T, D = dims(B=3, T=5, D=7)
INDEX = {"b": B, "t": T, "d": D}


def instance_norm(x: Tensor("btd"), g: Tensor("d")):
    mu = np.mean(x, axis=(-2, -1), keepdims=True)
    c = x - mu
    var = np.mean(c * c, axis=(1, 2), keepdims=True)
    return c / np.sqrt(var + 1e-5) * g
