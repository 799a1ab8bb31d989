"""RMSNorm with ** -0.5."""
import numpy as np

from datamove.dataflow.spec import Tensor, dims

B, T, D = dims(B=3, T=5, D=7)
INDEX = {"b": B, "t": T, "d": D}


def rmsnorm(x: Tensor("btd"), g: Tensor("d")):
    ms = np.mean(x ** 2, axis=-1, keepdims=True)
    y = x * (ms + 1e-6) ** -0.5 * g
    return y
