"""np.einsum whose output lacks a letter that one operand alone has (e of w, then t of x): that
operand is summed over it first."""
import numpy as np

from datamove.dataflow.spec import Tensor, dims

B, T, D, E = dims(B=3, T=5, D=7, E=4)
INDEX = {"b": B, "t": T, "d": D, "e": E}


def pooled(x: Tensor("btd"), w: Tensor("de")):
    scores = np.tanh(np.einsum("btd,de->bt", x, w))
    return scores[:, :, None] * np.einsum("btd,de->be", x, w)[:, None, :]
