"""np.einsum of three operands: contracted left to right, a pair without a summed letter (the
hidden state times a vector) a product."""
import numpy as np

from datamove.dataflow.spec import Tensor, dims

B, T, D, E, F = dims(B=3, T=5, D=7, E=4, F=6)
INDEX = {"b": B, "t": T, "d": D, "e": E, "f": F}


def chain(x: Tensor("btd"), w1: Tensor("de"), w2: Tensor("ef"), v: Tensor("f")):
    h = np.tanh(np.einsum("btd,de,ef->btf", x, w1, w2))
    return np.einsum("btf,f,ef->bte", h, v, w2)
