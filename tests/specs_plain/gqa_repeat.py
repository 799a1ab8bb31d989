"""Grouped-query attention as HF's repeat_kv writes it: K and V heads repeated over the query
groups with np.repeat (the count as H // KV, or a module-level G = H // KV and the method form)."""
import numpy as np

from datamove.dataflow.spec import Tensor, dims

B, T, D, H, KV, E = dims(B=2, T=5, D=7, H=6, KV=2, E=3)
INDEX = {"b": B, "s": T, "t": T, "d": D, "h": H, "k": KV, "e": E}
G = H // KV


def gqa(x: Tensor("bsd"), wq: Tensor("dhe"), wk: Tensor("dke"), wv: Tensor("dke"), wo: Tensor("hed")):
    q = np.einsum("bsd,dhe->bhse", x, wq)
    k = np.repeat(np.einsum("btd,dke->bkte", x, wk), H // KV, axis=1)
    v = np.einsum("btd,dke->bkte", x, wv).repeat(G, axis=1)
    scores = q @ k.transpose(0, 1, 3, 2) / np.sqrt(E)
    p = np.exp(scores - scores.max(axis=-1, keepdims=True))
    p = p / p.sum(axis=-1, keepdims=True)
    return np.einsum("bhse,hed->bsd", p @ v, wo)
