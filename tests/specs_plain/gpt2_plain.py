"""A GPT-2 block in plain NumPy: pre-LayerNorm with mean/var, causal mask, GELU with x ** 3,
biases broadcast by NumPy's rules, dropout, the residual stream reassigned."""
import numpy as np

from datamove.dataflow.spec import Dropout, Tensor, dims

B, T, D, H, E, F = dims(B=2, T=5, D=7, H=3, E=4, F=9)
INDEX = {"b": B, "s": T, "t": T, "d": D, "h": H, "e": E, "f": F}


def layernorm(x, g, b, eps=1e-5):
    mean = x.mean(axis=-1, keepdims=True)
    var = x.var(axis=-1, keepdims=True)
    return (x - mean) / np.sqrt(var + eps) * g + b


def gelu(x):
    return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x ** 3)))


def softmax(x):
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def gpt2_block(x: Tensor("bsd"), ln1_g: Tensor("d"), ln1_b: Tensor("d"),
               wq: Tensor("hde"), bq: Tensor("he"), wk: Tensor("hde"), bk: Tensor("he"),
               wv: Tensor("hde"), bv: Tensor("he"), wo: Tensor("hed"), bo: Tensor("d"),
               ln2_g: Tensor("d"), ln2_b: Tensor("d"), w_fc: Tensor("df"), b_fc: Tensor("f"),
               w_out: Tensor("fd"), b_out: Tensor("d"), causal: Tensor("st", requires_grad=False),
               drop_attn: Dropout("bhst", 0.1), drop_res: Dropout("bsd", 0.1), drop_mlp: Dropout("bsd", 0.1)):
    h = layernorm(x, ln1_g, ln1_b)[:, None]
    q = h @ wq + bq[:, None, :]
    k = h @ wk + bk[:, None, :]
    v = h @ wv + bv[:, None, :]
    att = softmax(q @ np.swapaxes(k, -2, -1) / np.sqrt(E) + causal) * drop_attn
    x = x + (np.einsum("bhse,hed->bsd", att @ v, wo) + bo) * drop_res
    x = x + (gelu(layernorm(x, ln2_g, ln2_b) @ w_fc + b_fc) @ w_out + b_out) * drop_mlp
    return x
