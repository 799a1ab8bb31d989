"""BERT-large encoder layer, forward pass, as a datamove spec (Ivanov et al., Fig. 2 and Table III).

Post-LayerNorm: ``y = LN(x1 + drop(W2 act(W1 x1 + b1) + b2))`` with ``x1 = LN(x + drop(MHA(x)))``.
Index letters follow the paper: i = model dim (N), b = batch (B), j / k = query / key position (L),
h = heads (H), p / w = query-key / value projection dims (P), u = feed-forward dim (U).
Every tensor is stored in the order of its letters, e.g. ``x`` is [N, B, L] ("ibj").
Dropout is a multiplication by a declared mask (values 0 or 1/(1-p), p rounded to a multiple of 1/256); datamove regenerates it.
"""
import numpy as np

from dataflow.spec import Dropout, Tensor, dims

B, L, N, H, P, U = dims(B=8, L=512, N=1024, H=16, P=64, U=4096)
INDEX = {"b": B, "j": L, "k": L, "i": N, "h": H, "p": P, "w": P, "u": U}
OPTIONS = {"activation": ("relu", "gelu")}  # first value is the default; --set activation=gelu
ACTIVATION = "relu"
P_DROP = 0.1


def layernorm(x, gamma, beta):
    """Normalise x[i, b, j] over i; gamma, beta: [i]."""
    mean = np.sum(x, axis=0) / np.float32(N)
    diff = x - mean[None, :, :]
    var = np.sum(diff * diff, axis=0) / np.float32(N)
    return diff / np.sqrt(var[None, :, :] + np.float32(1e-12)) * gamma[:, None, None] + beta[:, None, None]


def gelu(x):
    """tanh form of GELU."""
    return np.float32(0.5) * x * (np.float32(1) + np.tanh(np.float32(0.7978845608028654) * (x + np.float32(0.044715) * x * x * x)))


def bert_layer(x: Tensor("ibj"),
               wq: Tensor("phi"), bq: Tensor("ph"), wk: Tensor("phi"), bk: Tensor("ph"),
               wv: Tensor("whi"), bv: Tensor("wh"), wo: Tensor("whi"), bo: Tensor("i"),
               ln1_gamma: Tensor("i"), ln1_beta: Tensor("i"),
               w1: Tensor("ui"), b1: Tensor("u"), w2: Tensor("iu"), b2: Tensor("i"),
               ln2_gamma: Tensor("i"), ln2_beta: Tensor("i"),
               drop_attn: Dropout("hbjk", P_DROP), drop_attn_out: Dropout("ibj", P_DROP),
               drop_act: Dropout("ubj", P_DROP), drop_ffn_out: Dropout("ibj", P_DROP)):
    # multi-head self-attention
    q = np.einsum("phi,ibj->phbj", wq, x) + bq[:, :, None, None]
    k = np.einsum("phi,ibk->phbk", wk, x) + bk[:, :, None, None]
    v = np.einsum("whi,ibk->whbk", wv, x) + bv[:, :, None, None]
    scores = np.einsum("phbk,phbj->hbjk", k, q) / np.sqrt(np.float32(P))
    smax = np.max(scores, axis=3)
    expd = np.exp(scores - smax[:, :, :, None])
    denom = np.sum(expd, axis=3)
    probs = expd / denom[:, :, :, None]
    alpha = probs * drop_attn
    gamma = np.einsum("whbk,hbjk->whbj", v, alpha)
    attn = np.einsum("whi,whbj->ibj", wo, gamma) + bo[:, None, None]
    resid1 = attn * drop_attn_out + x
    x1 = layernorm(resid1, ln1_gamma, ln1_beta)
    # feed-forward
    pre_act = np.einsum("ui,ibj->ubj", w1, x1) + b1[:, None, None]
    if ACTIVATION == "gelu":
        act = gelu(pre_act)
    else:
        act = np.maximum(pre_act, np.float32(0))
    hidden = act * drop_act
    ffn = np.einsum("iu,ubj->ibj", w2, hidden) + b2[:, None, None]
    resid2 = ffn * drop_ffn_out + x1
    y = layernorm(resid2, ln2_gamma, ln2_beta)
    return y
