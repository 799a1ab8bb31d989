"""Multi-head self-attention with per-head weights: x[:, None] @ w, .transpose, np.transpose, np.tensordot."""
import numpy as np

from datamove.dataflow.spec import Tensor, dims

B, T, D, H, E = dims(B=2, T=5, D=7, H=3, E=4)
INDEX = {"b": B, "s": T, "t": T, "d": D, "h": H, "e": E}


def mha(x: Tensor("bsd"), wq: Tensor("hde"), wk: Tensor("hde"), wv: Tensor("hde"), wo: Tensor("hed")):
    xh = x[:, None]
    q = xh @ wq
    k = xh @ wk
    v = xh @ wv
    scores = q @ k.transpose(0, 1, 3, 2) / np.sqrt(q.shape[-1])
    probs = np.exp(scores - np.max(scores, axis=-1, keepdims=True))
    probs /= np.sum(probs, axis=-1, keepdims=True)
    ctx = np.transpose(probs @ v, (0, 2, 1, 3))
    y = np.tensordot(ctx, wo, axes=([2, 3], [0, 1]))
    return y
