"""Three-layer MLP with a softmax, in the style of a public NumPy benchmark suite (npbench's mlp)."""
import numpy as np

from datamove.dataflow.spec import Tensor, dims

N, C0, C1, C2, C3 = dims(N=5, C0=7, C1=9, C2=11, C3=3)
INDEX = {"n": N, "a": C0, "b": C1, "c": C2, "d": C3}


def relu(x):
    return np.maximum(x, 0)


def softmax(x):
    tmp_max = np.maximum.reduce(x, axis=-1, keepdims=True)
    tmp_out = np.exp(x - tmp_max)
    tmp_sum = np.add.reduce(tmp_out, axis=-1, keepdims=True)
    return tmp_out / tmp_sum


def mlp(input: Tensor("na"), w1: Tensor("ab"), b1: Tensor("b"), w2: Tensor("bc"), b2: Tensor("c"),
        w3: Tensor("cd"), b3: Tensor("d")):
    x1 = relu(input @ w1 + b1)
    x2 = relu(x1 @ w2 + b2)
    out = softmax(x2 @ w3 + b3)
    return out
