"""GELU MLP with biases: np.tensordot, np.power, np.sqrt(2 / np.pi), a residual."""
import numpy as np

from datamove.dataflow.spec import Tensor, dims

B, T, D, F = dims(B=3, T=5, D=7, F=9)
INDEX = {"b": B, "t": T, "d": D, "f": F}


def gelu_mlp(x: Tensor("btd"), w1: Tensor("df"), b1: Tensor("f"), w2: Tensor("fd"), b2: Tensor("d")):
    h = np.tensordot(x, w1, axes=1) + b1
    g = 0.5 * h * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (h + 0.044715 * np.power(h, 3))))
    y = np.tensordot(g, w2, axes=([2], [0])) + b2 + x
    return y
