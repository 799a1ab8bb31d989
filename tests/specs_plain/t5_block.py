"""A T5-style block: RMSNorm without mean or bias, unscaled attention, ReLU MLP, no biases."""
import numpy as np

from datamove.dataflow.spec import Tensor, dims

B, T, D, H, E, F = dims(B=2, T=5, D=7, H=3, E=4, F=9)
INDEX = {"b": B, "s": T, "t": T, "d": D, "h": H, "e": E, "f": F}


def rms(x, g):
    return x / np.sqrt(np.mean(np.square(x), axis=-1, keepdims=True) + 1e-6) * g


def t5_block(x: Tensor("bsd"), g1: Tensor("d"), wq: Tensor("hde"), wk: Tensor("hde"), wv: Tensor("hde"),
             wo: Tensor("hed"), g2: Tensor("d"), wi: Tensor("df"), wf: Tensor("fd")):
    h = rms(x, g1)[:, None]
    q, k, v = h @ wq, h @ wk, h @ wv
    s = q @ np.swapaxes(k, 2, 3)
    p = np.exp(s - np.amax(s, axis=3, keepdims=True))
    p = p / p.sum(axis=3, keepdims=True)
    x1 = x + np.tensordot(np.transpose(p @ v, (0, 2, 1, 3)), wo, axes=2)
    y = x1 + np.maximum(rms(x1, g2) @ wi, 0.0) @ wf
    return y
