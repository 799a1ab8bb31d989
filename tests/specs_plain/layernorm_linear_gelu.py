"""LayerNorm + Linear + GELU, written plainly (mean, (x - mu) ** 2, h @ w + c, Python floats)."""
import numpy as np

from datamove.dataflow.spec import Tensor, dims

B, T, D, F = dims(B=3, T=5, D=7, F=9)
INDEX = {"b": B, "t": T, "d": D, "f": F}


def block(x: Tensor("btd"), g: Tensor("d"), beta: Tensor("d"), w: Tensor("df"), c: Tensor("f")):
    mu = x.mean(axis=-1, keepdims=True)
    var = ((x - mu) ** 2).mean(axis=-1, keepdims=True)
    h = (x - mu) / np.sqrt(var + 1e-5) * g + beta
    z = h @ w + c
    y = 0.5 * z * (1.0 + np.tanh(0.7978845608028654 * (z + 0.044715 * z ** 3)))
    return y
