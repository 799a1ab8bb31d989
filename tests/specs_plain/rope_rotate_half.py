"""Rotary position embeddings as HF writes them: rotate_half with x[..., :half], x[..., half:] and
np.concatenate((-x2, x1), axis=-1); halves of an odd head dim; the same cut written with explicit
bounds x[:, :, :, a:b]; a concatenation that puts the parts back in place (no matrix)."""
import numpy as np

from datamove.dataflow.spec import Tensor, dims

B, T, D, H, E = dims(B=2, T=5, D=7, H=3, E=5)
INDEX = {"b": B, "s": T, "d": D, "h": H, "e": E}


def rotate_half(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2:]
    return np.concatenate((-x2, x1), axis=-1)


def rope(x: Tensor("bsd"), wq: Tensor("dhe"), wk: Tensor("dhe"),
         cos: Tensor("se", requires_grad=False), sin: Tensor("se", requires_grad=False)):
    q = np.einsum("bsd,dhe->bhse", x, wq)
    k = np.einsum("bsd,dhe->bhse", x, wk)
    q = q * cos + rotate_half(q) * sin
    lo, hi = k[:, :, :, : E // 2], k[:, :, :, E // 2:]
    k = k * cos + np.concatenate((-hi, lo), axis=-1) * sin
    same = np.concatenate((lo, hi), axis=3) * 2.0
    return np.einsum("bhse,bhse->bsh", q, k + same)
