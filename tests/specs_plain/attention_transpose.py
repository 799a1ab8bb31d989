"""Single-head self-attention over one sequence: @, k.T, np.where masking, a residual."""
import numpy as np

from datamove.dataflow.spec import Tensor, dims

T, D, E = dims(T=5, D=7, E=3)
INDEX = {"s": T, "t": T, "d": D, "e": E}


def attention(x: Tensor("sd"), wq: Tensor("de"), wk: Tensor("de"), wv: Tensor("de"), wo: Tensor("ed"),
              causal: Tensor("st", requires_grad=False)):
    q = x @ wq
    k = x @ wk
    v = x @ wv
    scores = q @ k.T / np.sqrt(E)
    scores = np.where(causal < 0, -1e9, scores)
    p = np.exp(scores - scores.max(axis=-1, keepdims=True))
    p = p / p.sum(axis=-1, keepdims=True)
    y = (p @ v) @ wo + x
    return y
