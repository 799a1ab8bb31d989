"""GPT-J / PaLM parallel block: one pre-norm feeding attention and a GeGLU MLP, both added to x; softcapped scores,
relative-position bias as a weight, multi-query attention (one K/V head), biases only on q and the MLP output."""
import numpy as np
from datamove.dataflow.spec import Tensor, dims

B, T, D, H, E, F = dims(B=3, T=5, D=7, H=2, E=3, F=11)
INDEX = {"b": B, "s": T, "t": T, "d": D, "h": H, "e": E, "f": F}


def ln(x, g, b):
    m = np.mean(x, axis=-1, keepdims=True)
    v = np.var(x, axis=-1, keepdims=True)
    return (x - m) / np.sqrt(v + 1e-5) * g + b


def gelu(x):
    return 0.5 * x * (1 + np.tanh(0.7978845608 * (x + 0.044715 * x ** 3)))


def layer(x: Tensor("bsd"), g: Tensor("d"), beta: Tensor("d"), wq: Tensor("dhe"), bq: Tensor("he"),
          wk: Tensor("de"), wv: Tensor("de"), rel: Tensor("hst"), wo: Tensor("hed"),
          wg: Tensor("df"), wu: Tensor("df"), wd: Tensor("fd"), bd: Tensor("d")):
    h = ln(x, g, beta)
    q = np.einsum("bsd,dhe->bhse", h, wq) + bq[:, None, :]
    k = np.einsum("btd,de->bte", h, wk)
    v = np.einsum("btd,de->bte", h, wv)
    s = np.einsum("bhse,bte->bhst", q, k) / np.sqrt(E) + rel
    s = np.tanh(s / 5.0) * 5.0
    p = np.exp(s - np.max(s, axis=-1, keepdims=True))
    p = p / np.sum(p, axis=-1, keepdims=True)
    a = np.einsum("bhst,bte->bhse", p, v)
    att = np.einsum("bhse,hed->bsd", a, wo)
    mlp = (gelu(h @ wg) * (h @ wu)) @ wd + bd
    return x + att + mlp
