"""An MLP whose activation is made of np.clip (both bounds; the lower None; the method with a keyword),
np.log1p, np.expm1 and np.sign (a signed log), beside x clipped itself (a residual); np.clip and np.where
of numbers alone are numbers."""
import numpy as np

from datamove.dataflow.spec import Tensor, dims

B, T, D, F = dims(B=3, T=5, D=7, F=9)
INDEX = {"b": B, "t": T, "d": D, "f": F}


def clip_log1p(x: Tensor("btd"), w1: Tensor("df"), b1: Tensor("f"), w2: Tensor("fd")):
    h = x @ w1 + b1
    a = np.clip(h, -0.5, 0.75)
    signed_log = np.sign(h) * np.log1p(np.abs(h))
    e = np.expm1(np.clip(h, None, 1.0)) + np.expm1(h.clip(max=0.25))
    return (a + signed_log + np.where(2.0 < 1.0, 1.0, 0.5) * e) @ w2 + np.clip(x, -1.0, 1.25) * np.clip(2.0, 0.0, 1.5)
