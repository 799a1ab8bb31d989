"""Mistral's sliding-window causal attention, the mask from positions: each query sees itself and
the WINDOW - 1 keys before it (np.where over a comparison of np.arange positions)."""
import numpy as np

from datamove.dataflow.spec import Tensor, dims

B, T, D, H, E = dims(B=2, T=6, D=7, H=3, E=4)
INDEX = {"b": B, "s": T, "t": T, "d": D, "h": H, "e": E}
WINDOW = 3


def sliding_window(x: Tensor("bsd"), wq: Tensor("dhe"), wk: Tensor("dhe"), wv: Tensor("dhe"), wo: Tensor("hed")):
    q = np.einsum("bsd,dhe->bhse", x, wq)
    k = np.einsum("bsd,dhe->bhse", x, wk)
    v = np.einsum("bsd,dhe->bhse", x, wv)
    scores = q @ np.swapaxes(k, -1, -2) / np.sqrt(E)
    i = np.arange(T)[:, None]
    j = np.arange(T)[None, :]
    scores = np.where((j <= i) & (i - j < WINDOW), scores, -np.inf)
    p = np.exp(scores - np.max(scores, axis=-1, keepdims=True))
    p = p / np.sum(p, axis=-1, keepdims=True)
    return np.einsum("bhse,hed->bsd", p @ v, wo)
