"""np.einsum without output letters (NumPy's implicit mode) on a transposed operand, then an explicit one."""
import numpy as np

from datamove.dataflow.spec import Tensor, dims

B, T, D, F = dims(B=3, T=5, D=7, F=9)
INDEX = {"b": B, "t": T, "d": D, "f": F}


def projection(x: Tensor("btd"), w: Tensor("fd"), u: Tensor("fd")):
    h = np.einsum("ijk,kl", x, w.T)
    y = np.einsum("btf,fd->btd", np.tanh(h), u)
    return y + x
