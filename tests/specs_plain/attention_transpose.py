"""Single-head self-attention with @, .T-style transposes and np.where masking."""
import numpy as np

from dataflow.spec import Tensor, dims

B, T, D, E = dims(B=2, T=8, D=16, E=8)
INDEX = {"b": B, "s": T, "t": T, "d": D, "e": E}


def attention(x: Tensor("bsd"), wq: Tensor("de"), wk: Tensor("de"), wv: Tensor("de"), wo: Tensor("ed"),
              mask: Tensor("st", requires_grad=False)):
    q = x @ wq
    k = x @ wk
    v = x @ wv
    scores = q @ np.swapaxes(k, -1, -2) / np.sqrt(E)
    scores = np.where(mask > 0, scores, -1e9)
    p = np.exp(scores - scores.max(axis=-1, keepdims=True))
    p = p / p.sum(axis=-1, keepdims=True)
    y = (p @ v) @ wo + x
    return y
