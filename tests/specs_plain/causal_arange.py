"""Causal attention with the mask from a comparison of positions: np.arange(T)[:, None] >=
np.arange(T)[None, :] through np.where(..., 0, -inf), added to the scores; a multiplicative
window (np.triu with an offset) as a second constant."""
import numpy as np

from datamove.dataflow.spec import Tensor, dims

B, T, D, H, E = dims(B=2, T=5, D=7, H=3, E=4)
INDEX = {"b": B, "s": T, "t": T, "d": D, "h": H, "e": E}


def causal_arange(x: Tensor("bsd"), wq: Tensor("dhe"), wk: Tensor("dhe"), wv: Tensor("dhe"), wo: Tensor("hed")):
    q = np.einsum("bsd,dhe->bhse", x, wq)
    k = np.einsum("bsd,dhe->bhse", x, wk)
    v = np.einsum("bsd,dhe->bhse", x, wv)
    visible = np.arange(T)[:, None] >= np.arange(T)[None, :]
    bias = np.where(visible, 0.0, -np.inf)
    scores = q @ k.transpose(0, 1, 3, 2) / np.sqrt(E) + bias
    p = np.exp(scores - scores.max(axis=-1, keepdims=True))
    p = p / p.sum(axis=-1, keepdims=True)
    recent = 1.0 - np.triu(np.ones((T, T)), k=3)  # 0 for keys 3 or more after the query
    return np.einsum("bhse,hed->bsd", (p * recent) @ v, wo)
