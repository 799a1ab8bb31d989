"""GPT-2 style decoder block, forward pass, as a datamove spec: NOT BERT-shaped on purpose.

Pre-LayerNorm (``x1 = x + drop(attn(LN(x)))``, ``y = x1 + drop(mlp(LN(x1)))``), causal
self-attention through an additive mask, GELU (tanh form), tensors stored batch-major
([B, T, D]), and its own letters: b batch, s / t query / key position (T), d model dim (D),
h heads, e head dim (E), f MLP dim (F).
"""
import numpy as np

from datamove.dataflow.spec import Dropout, Tensor, dims

B, T, D, H, E, F = dims(B=4, T=1024, D=768, H=12, E=64, F=3072)
INDEX = {"b": B, "s": T, "t": T, "d": D, "h": H, "e": E, "f": F}
P_DROP = 0.1


def HF_CONFIG(sizes):
    """The ``transformers.GPT2Config`` values this block computes at ``sizes`` ({dim: size}):
    ``load_weights`` and ``replace_gpt2_blocks`` refuse a model configured otherwise (a list: values
    computing the same; the head count included)."""
    return {"activation_function": ["gelu_new", "gelu_pytorch_tanh"], "layer_norm_epsilon": 1e-5,
            "attn_pdrop": P_DROP, "resid_pdrop": P_DROP, "n_head": sizes["H"], "scale_attn_weights": True,
            "scale_attn_by_inverse_layer_idx": False, "reorder_and_upcast_attn": False, "add_cross_attention": False}


# Where each parameter lives in a HF ``GPT2Block`` (``datamove.runtime.weights``): Conv1D weights are stored
# [in, out]; ``c_attn`` holds Q, K and V side by side along its output dim.
WEIGHTS = {
    "transformers.GPT2Block": {
        "ln1_gain": ("ln_1.weight", "d", None), "ln1_bias": ("ln_1.bias", "d", None),
        "wq": ("attn.c_attn.weight", "d (3 h e)", 0), "bq": ("attn.c_attn.bias", "(3 h e)", 0),
        "wk": ("attn.c_attn.weight", "d (3 h e)", 1), "bk": ("attn.c_attn.bias", "(3 h e)", 1),
        "wv": ("attn.c_attn.weight", "d (3 h e)", 2), "bv": ("attn.c_attn.bias", "(3 h e)", 2),
        "wproj": ("attn.c_proj.weight", "(h e) d", None), "bproj": ("attn.c_proj.bias", "d", None),
        "ln2_gain": ("ln_2.weight", "d", None), "ln2_bias": ("ln_2.bias", "d", None),
        "wfc": ("mlp.c_fc.weight", "d f", None), "bfc": ("mlp.c_fc.bias", "f", None),
        "wout": ("mlp.c_proj.weight", "f d", None), "bout": ("mlp.c_proj.bias", "d", None),
    },
}


def layernorm(x, gain, bias):
    """Normalise x[b, s, d] over d; gain, bias: [d]."""
    mean = np.sum(x, axis=2) / np.float32(D)
    centred = x - mean[:, :, None]
    var = np.sum(centred * centred, axis=2) / np.float32(D)
    return centred / np.sqrt(var[:, :, None] + np.float32(1e-5)) * gain[None, None, :] + bias[None, None, :]


def gpt2_block(x: Tensor("bsd"),
               ln1_gain: Tensor("d"), ln1_bias: Tensor("d"),
               wq: Tensor("dhe"), bq: Tensor("he"), wk: Tensor("dhe"), bk: Tensor("he"),
               wv: Tensor("dhe"), bv: Tensor("he"), wproj: Tensor("hed"), bproj: Tensor("d"),
               ln2_gain: Tensor("d"), ln2_bias: Tensor("d"),
               wfc: Tensor("df"), bfc: Tensor("f"), wout: Tensor("fd"), bout: Tensor("d"),
               causal: Tensor("st", requires_grad=False),
               drop_probs: Dropout("bhst", P_DROP), drop_attn: Dropout("bsd", P_DROP),
               drop_mlp: Dropout("bsd", P_DROP)):
    # causal self-attention on the normalised input; causal[s, t] is 0 where t <= s, else -1e4
    h1 = layernorm(x, ln1_gain, ln1_bias)
    q = np.einsum("bsd,dhe->bhse", h1, wq) + bq[None, :, None, :]
    k = np.einsum("btd,dhe->bhte", h1, wk) + bk[None, :, None, :]
    v = np.einsum("btd,dhe->bhte", h1, wv) + bv[None, :, None, :]
    logits = np.einsum("bhse,bhte->bhst", q, k) / np.sqrt(np.float32(E)) + causal[None, None, :, :]
    top = np.max(logits, axis=3)
    weights = np.exp(logits - top[:, :, :, None])
    total = np.sum(weights, axis=3)
    attention = weights / total[:, :, :, None] * drop_probs
    context = np.einsum("bhst,bhte->bhse", attention, v)
    x1 = x + (np.einsum("bhse,hed->bsd", context, wproj) + bproj[None, None, :]) * drop_attn
    # MLP
    h2 = layernorm(x1, ln2_gain, ln2_bias)
    up = np.einsum("bsd,df->bsf", h2, wfc) + bfc[None, None, :]
    gelu = np.float32(0.5) * up * (np.float32(1) + np.tanh(np.float32(0.7978845608028654) * (up + np.float32(0.044715) * up * up * up)))
    y = x1 + (np.einsum("bsf,fd->bsd", gelu, wout) + bout[None, None, :]) * drop_mlp
    return y
