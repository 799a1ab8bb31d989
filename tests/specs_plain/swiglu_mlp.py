"""SiLU-gated MLP (LLaMA's): @, np.matmul, np.dot, SiLU written out."""
import numpy as np

from datamove.dataflow.spec import Tensor, dims

B, T, D, F = dims(B=3, T=5, D=7, F=11)
INDEX = {"b": B, "t": T, "d": D, "f": F}


def swiglu(x: Tensor("btd"), w_gate: Tensor("df"), w_up: Tensor("df"), w_down: Tensor("fd")):
    gate = x @ w_gate
    up = np.matmul(x, w_up)
    act = gate / (1.0 + np.exp(-gate)) * up
    return np.dot(act, w_down)
