"""Causal attention with the mask built in the layer: np.tril of np.ones used through np.where
(masked_fill with -inf)."""
import numpy as np

from datamove.dataflow.spec import Tensor, dims

B, T, D, H, E = dims(B=2, T=5, D=7, H=3, E=4)
INDEX = {"b": B, "s": T, "t": T, "d": D, "h": H, "e": E}


def causal_tril(x: Tensor("bsd"), wq: Tensor("dhe"), wk: Tensor("dhe"), wv: Tensor("dhe"), wo: Tensor("hed")):
    q = np.einsum("bsd,dhe->bhse", x, wq)
    k = np.einsum("bsd,dhe->bhse", x, wk)
    v = np.einsum("bsd,dhe->bhse", x, wv)
    scores = q @ np.swapaxes(k, -1, -2) / np.sqrt(E)
    keep = np.tril(np.ones((T, T)))
    scores = np.where(keep == 0, -np.inf, scores)
    p = np.exp(scores - np.max(scores, axis=-1, keepdims=True))
    p = p / np.sum(p, axis=-1, keepdims=True)
    return np.einsum("bhse,hed->bsd", p @ v, wo)
