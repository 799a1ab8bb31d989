"""A projection einsum passed straight into a spec helper (once DaCe's "KeyError: SDFGState").
"""
import numpy as np

from datamove.dataflow.spec import Tensor, dims

B, T, D, H, E = dims(B=2, T=5, D=7, H=3, E=4)
INDEX = {"b": B, "s": T, "d": D, "h": H, "e": E}


def scale_shift(x, cos, sin):
    return x * cos + sin


def helper_einsum_arg(h: Tensor("bsd"), wq: Tensor("dhe"), wo: Tensor("hed"),
                      cos: Tensor("se", requires_grad=False), sin: Tensor("se", requires_grad=False)):
    q = scale_shift(np.einsum("bsd,dhe->bhse", h, wq), cos, sin)
    return np.einsum("bhse,hed->bsd", np.tanh(q), wo)
