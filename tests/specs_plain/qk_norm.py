"""QK-norm attention (RMSNorm of q and k per head, OLMo-2 / Gemma-3 style) with a causal mask from np.tril and a
layer-scaled residual: q @ k.T of two helper results of one shape (the helper's returned arrays, renamed by DaCe's
simplification, must not trade places)."""
import numpy as np

from datamove.dataflow.spec import Tensor, dims

B, T, D, H, E = dims(B=2, T=7, D=5, H=3, E=4)
INDEX = {"b": B, "s": T, "t": T, "d": D, "h": H, "e": E}


def rms(z, g):
    return z / np.sqrt(np.mean(z ** 2, axis=-1, keepdims=True) + 1e-6) * g


def qk_norm(x: Tensor("bsd"), wq: Tensor("dhe"), wk: Tensor("dhe"), wv: Tensor("dhe"), gq: Tensor("e"),
            gk: Tensor("e"), wo: Tensor("hed"), ls: Tensor("d")):
    q = rms(np.einsum("bsd,dhe->bhse", x, wq), gq)
    k = rms(np.einsum("bsd,dhe->bhse", x, wk), gk)
    v = np.einsum("bsd,dhe->bhse", x, wv)
    s = q @ np.swapaxes(k, -1, -2) * (1.0 / np.sqrt(E))
    s = np.where(np.tril(np.ones((T, T))) == 0, -np.inf, s)
    p = np.exp(s - s.max(axis=-1, keepdims=True))
    p = p / p.sum(axis=-1, keepdims=True)
    return x + 0.5 * np.einsum("bhse,hed->bsd", p @ v, wo) * ls
