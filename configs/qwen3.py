"""Qwen3 decoder layer, forward pass, written as HF's ``Qwen3DecoderLayer`` computes it, in plain
NumPy: ``configs/llama.py``'s layer with an RMSNorm of every query and key head over the head dim
(``q_norm``, ``k_norm``: one gain [E] each, shared by the heads), applied after the projections and
before the rotary embedding; no biases.

Pre-RMSNorm (``h = x + attn(norm(x))``, ``y = h + mlp(norm(h))``), rotary position embeddings
through ``rotate_half``, grouped-query attention (``np.repeat`` of K and V), causal attention
(``np.triu``), SwiGLU MLP, no dropout.  Letters: b batch, s / t query / key position (T), d model
dim (D), h query heads (H), k key/value heads (KV), e head dim (E), f MLP dim (F).  ``cos`` and
``sin`` ([T, E]) are the model's rotary tables, set by ``replace_decoder_layers``
(``layer.set_constant``), as in ``configs/llama.py``.
"""
import numpy as np

from datamove.dataflow.spec import Tensor, dims

B, T, D, H, KV, E, F = dims(B=2, T=16, D=64, H=4, KV=2, E=16, F=128)
INDEX = {"b": B, "s": T, "t": T, "d": D, "h": H, "k": KV, "e": E, "f": F}
EPS = 1e-6  # every RMSNorm's epsilon, the heads' too (config.rms_norm_eps; Qwen3Config's default)

# cos and sin hold positions 0, 1, ... along s: a call at a shorter sequence reads their leading rows
# (datamove.runtime.call_constants), so the layer runs any length up to T
POSITION_TABLES = ("cos", "sin")

def HF_CONFIG(sizes):
    """The HF ``Qwen3Config`` values this layer computes at ``sizes`` ({dim: size}):
    ``replace_decoder_layers`` and ``load_weights`` refuse a model configured otherwise.  The
    attention is causal over all T positions: a sliding window (``use_sliding_window=True``) is
    taken only where it covers them (``{"at least": T}``); the rotary tables are the model's,
    whatever its ``rope_parameters``."""
    return {"rms_norm_eps": EPS, "hidden_act": ["silu", "swish"], "attention_dropout": 0.0, "attention_bias": False,
            "num_attention_heads": sizes["H"], "num_key_value_heads": sizes["KV"], "head_dim": sizes["E"],
            "sliding_window": [None, {"at least": sizes["T"]}]}


# Where each parameter lives in a HF ``Qwen3DecoderLayer`` (``datamove.runtime.weights``): nn.Linear weights
# are stored [out, in], the heads outer in the output dim.
WEIGHTS = {
    "transformers.Qwen3DecoderLayer": {
        "attn_norm": ("input_layernorm.weight", "d", None),
        "wq": ("self_attn.q_proj.weight", "(h e) d", None),
        "wk": ("self_attn.k_proj.weight", "(k e) d", None),
        "wv": ("self_attn.v_proj.weight", "(k e) d", None),
        "q_norm": ("self_attn.q_norm.weight", "e", None),
        "k_norm": ("self_attn.k_norm.weight", "e", None),
        "wo": ("self_attn.o_proj.weight", "d (h e)", None),
        "mlp_norm": ("post_attention_layernorm.weight", "d", None),
        "w_gate": ("mlp.gate_proj.weight", "f d", None),
        "w_up": ("mlp.up_proj.weight", "f d", None),
        "w_down": ("mlp.down_proj.weight", "d f", None),
    },
}


def rms_norm(x, weight):
    """RMSNorm over the last axis (the model dim, or a head's dim)."""
    variance = np.mean(x ** 2, axis=-1, keepdims=True)
    return weight * (x / np.sqrt(variance + EPS))


def rotate_half(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2:]
    return np.concatenate((-x2, x1), axis=-1)


def apply_rotary(x, cos, sin):
    return x * cos + rotate_half(x) * sin


def repeat_kv(x, n_rep):
    return np.repeat(x, n_rep, axis=1)


def sigmoid(x):
    return 1 / (1 + np.exp(-x))


def qwen3_layer(x: Tensor("bsd"), attn_norm: Tensor("d"),
                wq: Tensor("dhe"), wk: Tensor("dke"), wv: Tensor("dke"), q_norm: Tensor("e"), k_norm: Tensor("e"),
                wo: Tensor("hed"), mlp_norm: Tensor("d"), w_gate: Tensor("df"), w_up: Tensor("df"), w_down: Tensor("fd"),
                cos: Tensor("se", requires_grad=False), sin: Tensor("se", requires_grad=False)):
    # self-attention
    h = rms_norm(x, attn_norm)
    q = apply_rotary(rms_norm(np.einsum("bsd,dhe->bhse", h, wq), q_norm), cos, sin)
    k = apply_rotary(rms_norm(np.einsum("bsd,dke->bkse", h, wk), k_norm), cos, sin)
    v = np.einsum("bsd,dke->bkse", h, wv)
    k = repeat_kv(k, H // KV)
    v = repeat_kv(v, H // KV)
    scores = q @ k.transpose(0, 1, 3, 2) * E ** -0.5
    causal = np.triu(np.full((T, T), -np.inf), k=1)
    scores = scores + causal
    probs = np.exp(scores - scores.max(axis=-1, keepdims=True))
    probs = probs / probs.sum(axis=-1, keepdims=True)
    context = probs @ v
    x = x + np.einsum("bhse,hed->bsd", context, wo)
    # SwiGLU MLP
    h = rms_norm(x, mlp_norm)
    gate = h @ w_gate
    y = x + (gate * sigmoid(gate) * (h @ w_up)) @ w_down
    return y
