"""Pre-RMSNorm (HF's form: weight * (x / sqrt(mean(x^2) + eps))) and SiLU written three ways, with
linears without biases: x * sigmoid(x) through a helper, x / (1 + exp(-x)), x * (1 / (1 + exp(-x)))."""
import numpy as np

from datamove.dataflow.spec import Tensor, dims

B, T, D, F = dims(B=3, T=5, D=7, F=11)
INDEX = {"b": B, "t": T, "d": D, "f": F}


def sigmoid(x):
    return 1 / (1 + np.exp(-x))


def silu_forms(x: Tensor("btd"), g: Tensor("d"), w1: Tensor("df"), w2: Tensor("df"), w3: Tensor("df"),
               w_out: Tensor("fd")):
    h = g * (x / np.sqrt(np.mean(x ** 2, axis=-1, keepdims=True) + 1e-6))
    a = h @ w1
    b = h @ w2
    c = h @ w3
    act = a * sigmoid(a) + b / (1 + np.exp(-b)) + c * (1 / (1 + np.exp(-c)))
    return x + act @ w_out
