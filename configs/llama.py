"""Llama-3 style decoder layer, forward pass, written as its authors write it (HF's
``LlamaDecoderLayer``; Mistral's ``MistralDecoderLayer`` is the same layer), in plain NumPy.

Pre-RMSNorm (``h = x + attn(norm(x))``, ``y = h + mlp(norm(h))``), Q/K/V/O projections without
biases, rotary position embeddings through ``rotate_half`` (slices and ``np.concatenate``),
grouped-query attention (H query heads share KV key/value heads: ``np.repeat`` of K and V over the
query groups, as HF's ``repeat_kv``), causal attention (a mask built with ``np.triu``), SwiGLU MLP
(``down(silu(gate(h)) * up(h))``), no dropout.  Letters: b batch, s / t query / key position (T),
d model dim (D), h query heads (H), k key/value heads (KV), e head dim (E), f MLP dim (F).

``cos`` and ``sin`` ([T, E], HF's ``position_embeddings`` for positions 0..T-1) are constants of
the layer whose value comes from the model (``layer.set_constant("cos", table)``), declared
position tables (``POSITION_TABLES``: a call at T' <= T reads their first T' rows); the rotation of
``rotate_half``, the repetition of ``np.repeat`` and the causal mask are constants the front end
makes with their values (``datamove.dataflow.numpy_lowering``).
"""
import numpy as np

from datamove.dataflow.spec import Tensor, dims

B, T, D, H, KV, E, F = dims(B=2, T=16, D=64, H=4, KV=2, E=16, F=128)
INDEX = {"b": B, "s": T, "t": T, "d": D, "h": H, "k": KV, "e": E, "f": F}
EPS = 1e-5  # RMSNorm's epsilon (config.rms_norm_eps)
# cos and sin hold positions 0, 1, ... along s: a call at a shorter sequence reads their leading rows
# (datamove.runtime.call_constants), so the layer runs any length up to T
POSITION_TABLES = ("cos", "sin")


def HF_CONFIG(sizes):
    """The HF ``LlamaConfig`` / ``MistralConfig`` values this layer computes at ``sizes`` ({dim:
    size}): ``load_weights`` and ``replace_decoder_layers`` refuse a model configured otherwise (the
    head counts and head dim included: 16 heads of 128 fill the weights of 32 heads of 64; "swish"
    is HF's other name of SiLU; a key the config lacks, Mistral's biases, passes).  The attention is
    causal over all T positions: Mistral's sliding window is taken where it covers them
    (``{"at least": T}``: Mistral-7B-v0.1's 4096 at T <= 4096; later ones have none); the rotary
    tables are the model's, whatever its ``rope_parameters`` (Llama-3's scaling included)."""
    return {"rms_norm_eps": EPS, "hidden_act": ["silu", "swish"], "attention_dropout": 0.0, "attention_bias": False,
            "mlp_bias": False, "num_attention_heads": sizes["H"], "num_key_value_heads": sizes["KV"],
            "head_dim": sizes["E"], "sliding_window": [None, {"at least": sizes["T"]}]}


# Where each parameter lives in a HF ``LlamaDecoderLayer`` (``datamove.runtime.weights``): nn.Linear weights
# are stored [out, in], the heads outer in the output dim.  A ``MistralDecoderLayer`` is the same layer.
LLAMA_LAYER = {
    "attn_norm": ("input_layernorm.weight", "d", None),
    "wq": ("self_attn.q_proj.weight", "(h e) d", None),
    "wk": ("self_attn.k_proj.weight", "(k e) d", None),
    "wv": ("self_attn.v_proj.weight", "(k e) d", None),
    "wo": ("self_attn.o_proj.weight", "d (h e)", None),
    "mlp_norm": ("post_attention_layernorm.weight", "d", None),
    "w_gate": ("mlp.gate_proj.weight", "f d", None),
    "w_up": ("mlp.up_proj.weight", "f d", None),
    "w_down": ("mlp.down_proj.weight", "d f", None),
}
WEIGHTS = {"transformers.LlamaDecoderLayer": LLAMA_LAYER, "transformers.MistralDecoderLayer": LLAMA_LAYER}


def rms_norm(x, weight):
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


def llama_layer(x: Tensor("bsd"), attn_norm: Tensor("d"),
                wq: Tensor("dhe"), wk: Tensor("dke"), wv: Tensor("dke"), wo: Tensor("hed"),
                mlp_norm: Tensor("d"), w_gate: Tensor("df"), w_up: Tensor("df"), w_down: Tensor("fd"),
                cos: Tensor("se", requires_grad=False), sin: Tensor("se", requires_grad=False)):
    # self-attention
    h = rms_norm(x, attn_norm)
    q = apply_rotary(np.einsum("bsd,dhe->bhse", h, wq), cos, sin)
    k = apply_rotary(np.einsum("bsd,dke->bkse", h, wk), cos, sin)
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
