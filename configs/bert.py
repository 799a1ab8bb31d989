"""BERT-large encoder layer, forward pass, as a datamove spec (Ivanov et al., Fig. 2 and Table III).

Post-LayerNorm: ``y = LN(x1 + drop(W2 act(W1 x1 + b1) + b2))`` with ``x1 = LN(x + drop(MHA(x)))``.
Index letters follow the paper: i = model dim (N), b = batch (B), j / k = query / key position (L),
h = heads (H), p / w = query-key / value projection dims (P), u = feed-forward dim (U).
Every tensor is stored in the order of its letters, e.g. ``x`` is [N, B, L] ("ibj").
Dropout is a multiplication by a declared mask (values 0 or 1/(1-p), p rounded to a multiple of 1/256); datamove regenerates it.
"""
import numpy as np

from datamove.dataflow.spec import Dropout, Tensor, dims

B, L, N, H, P, U = dims(B=8, L=512, N=1024, H=16, P=64, U=4096)
INDEX = {"b": B, "j": L, "k": L, "i": N, "h": H, "p": P, "w": P, "u": U}
OPTIONS = {"activation": ("relu", "gelu")}  # first value is the default; --set activation=gelu
ACTIVATION = "relu"
P_DROP = 0.1
EPS = 1e-12  # LayerNorm's


def HF_CONFIG(sizes):
    """The ``transformers.BertConfig`` values this layer computes at ``sizes`` ({dim: size}), read
    after the ``--set`` options (``load_weights`` and ``replace_bert_layers`` refuse a model configured
    otherwise; a list: values computing the same).  The head count included: 4 heads of 8 fill the
    weights of 2 heads of 16."""
    return {"hidden_act": ["gelu_new", "gelu_pytorch_tanh"] if ACTIVATION == "gelu" else "relu",
            "layer_norm_eps": EPS, "attention_probs_dropout_prob": P_DROP, "hidden_dropout_prob": P_DROP,
            "num_attention_heads": sizes["H"]}


def MODULE_CONFIG(sizes):
    """The settings of the PyTorch modules in ``WEIGHTS`` (attribute paths) this layer computes with;
    ``load_weights`` refuses a module set otherwise (not its dropout, which ``train()`` / ``eval()``
    governs).  ``nn.TransformerEncoderLayer``'s ``"gelu"`` is the erf form, not this spec's tanh form:
    that activation is given as a function (``activation_relu_or_gelu`` 0)."""
    return {"torch.nn.TransformerEncoderLayer": {
        "norm_first": False, "self_attn.batch_first": True, "self_attn.num_heads": sizes["H"],
        "norm1.eps": EPS, "norm2.eps": EPS, "activation_relu_or_gelu": 0 if ACTIVATION == "gelu" else 1}}


# How the layer meets PyTorch (datamove.export): the order of its activations' dims there
# (HF hidden states are [batch, sequence, feature]), and where the weights of PyTorch modules
# computing this layer go: (state-dict key, the key's dims as letters of this spec, "(h p)" merging
# letters into one dim and a leading count stacking, index into that stack or None).
TORCH_ORDER = {"x": "bji", "y": "bji"}
WEIGHTS = {
    "transformers.BertLayer": {
        "wq": ("attention.self.query.weight", "(h p) i", None), "bq": ("attention.self.query.bias", "(h p)", None),
        "wk": ("attention.self.key.weight", "(h p) i", None), "bk": ("attention.self.key.bias", "(h p)", None),
        "wv": ("attention.self.value.weight", "(h w) i", None), "bv": ("attention.self.value.bias", "(h w)", None),
        "wo": ("attention.output.dense.weight", "i (h w)", None), "bo": ("attention.output.dense.bias", "i", None),
        "ln1_gamma": ("attention.output.LayerNorm.weight", "i", None),
        "ln1_beta": ("attention.output.LayerNorm.bias", "i", None),
        "w1": ("intermediate.dense.weight", "u i", None), "b1": ("intermediate.dense.bias", "u", None),
        "w2": ("output.dense.weight", "i u", None), "b2": ("output.dense.bias", "i", None),
        "ln2_gamma": ("output.LayerNorm.weight", "i", None), "ln2_beta": ("output.LayerNorm.bias", "i", None),
    },
    "torch.nn.TransformerEncoderLayer": {  # batch_first=True, norm_first=False (MODULE_CONFIG)
        "wq": ("self_attn.in_proj_weight", "(3 h p) i", 0), "bq": ("self_attn.in_proj_bias", "(3 h p)", 0),
        "wk": ("self_attn.in_proj_weight", "(3 h p) i", 1), "bk": ("self_attn.in_proj_bias", "(3 h p)", 1),
        "wv": ("self_attn.in_proj_weight", "(3 h w) i", 2), "bv": ("self_attn.in_proj_bias", "(3 h w)", 2),
        "wo": ("self_attn.out_proj.weight", "i (h w)", None), "bo": ("self_attn.out_proj.bias", "i", None),
        "ln1_gamma": ("norm1.weight", "i", None), "ln1_beta": ("norm1.bias", "i", None),
        "w1": ("linear1.weight", "u i", None), "b1": ("linear1.bias", "u", None),
        "w2": ("linear2.weight", "i u", None), "b2": ("linear2.bias", "i", None),
        "ln2_gamma": ("norm2.weight", "i", None), "ln2_beta": ("norm2.bias", "i", None),
    },
}


def layernorm(x, gamma, beta):
    """Normalise x[i, b, j] over i; gamma, beta: [i]."""
    mean = np.sum(x, axis=0) / np.float32(N)
    diff = x - mean[None, :, :]
    var = np.sum(diff * diff, axis=0) / np.float32(N)
    return diff / np.sqrt(var[None, :, :] + np.float32(EPS)) * gamma[:, None, None] + beta[:, None, None]


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
