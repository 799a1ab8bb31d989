"""Multi-head cross-attention: queries from x, keys and values from a second sequence (memory) of
another length; a residual."""
import numpy as np

from datamove.dataflow.spec import Tensor, dims

B, T, S, D, H, E = dims(B=2, T=5, S=6, D=7, H=3, E=4)
INDEX = {"b": B, "t": T, "s": S, "d": D, "h": H, "e": E}


def cross_attention(x: Tensor("btd"), memory: Tensor("bsd"), wq: Tensor("hde"), wk: Tensor("hde"),
                    wv: Tensor("hde"), wo: Tensor("hed")):
    q = x[:, None] @ wq
    k = memory[:, None] @ wk
    v = memory[:, None] @ wv
    scores = q @ k.transpose(0, 1, 3, 2) / np.sqrt(q.shape[-1])
    probs = np.exp(scores - np.max(scores, axis=-1, keepdims=True))
    probs /= np.sum(probs, axis=-1, keepdims=True)
    ctx = np.transpose(probs @ v, (0, 2, 1, 3))
    y = np.tensordot(ctx, wo, axes=([2, 3], [0, 1])) + x
    return y
