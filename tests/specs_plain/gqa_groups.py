"""Grouped-query attention written with a group letter: query heads as (key/value head k, group g),
K and V broadcast over the groups (k[:, :, None]), read once; causal through an additive constant."""
import numpy as np

from datamove.dataflow.spec import Tensor, dims

B, T, D, KV, G, E = dims(B=2, T=5, D=7, KV=2, G=3, E=4)
INDEX = {"b": B, "s": T, "t": T, "d": D, "k": KV, "g": G, "e": E}


def gqa_groups(x: Tensor("bsd"), wq: Tensor("dkge"), wk: Tensor("dke"), wv: Tensor("dke"), wo: Tensor("kged"),
               causal: Tensor("st", requires_grad=False)):
    q = np.einsum("bsd,dkge->bkgse", x, wq)
    k = np.einsum("btd,dke->bkte", x, wk)
    v = np.einsum("btd,dke->bkte", x, wv)
    scores = np.einsum("bkgse,bkte->bkgst", q, k) / np.sqrt(E) + causal
    p = np.exp(scores - scores.max(axis=-1, keepdims=True))
    p = p / p.sum(axis=-1, keepdims=True)
    return np.einsum("bkgse,kged->bsd", p @ v[:, :, None], wo)
