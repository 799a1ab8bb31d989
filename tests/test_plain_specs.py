"""Specs written in plain NumPy (``tests/specs_plain/``): @, implicit broadcasting, keepdims,
mean/var/std, Python floats, transposes.  Each is analysed (fusion included), its operator
classes are checked, its forward graph is checked against NumPy running the spec itself, and its
training graph, run by the reference executor (unfused and fused), against torch.autograd on a
layer written here with torch's own operators, in float64 at the specs' small odd dims.
"""
import importlib.util
import json
import types
import warnings
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import sympy
import torch
import torch.nn.functional as F

from datamove.dataflow import snapshot
from datamove.dataflow.executor import dropout_masks, execute, known_value
from datamove.dataflow.initial_values import CausalMask, KnownValue, initial_values
from datamove.dataflow.layer_inputs import data_inputs
from datamove.dataflow.operators import CONTRACTION, ELEMENTWISE, NORMALIZATION
from datamove.dataflow.pipeline import analyse_spec
from test_executor import SEED, random_inputs, relative_error

warnings.filterwarnings("ignore", module="dace")

SPECS = Path(__file__).parent / "specs_plain"


def _softmax_heads(q, k, v, scale=True):
    scores = q @ k.transpose(-1, -2) / (q.shape[-1] ** 0.5 if scale else 1.0)
    return torch.softmax(scores, dim=-1) @ v


def _rms(x, g, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * g


def attention_transpose(t, m):
    q, k, v = t["x"] @ t["wq"], t["x"] @ t["wk"], t["x"] @ t["wv"]
    scores = torch.where(t["causal"] < 0, -1e9, q @ k.T / q.shape[-1] ** 0.5)
    return torch.softmax(scores, dim=-1) @ v @ t["wo"] + t["x"]


def mlp_softmax(t, m):
    x1 = torch.relu(t["input"] @ t["w1"] + t["b1"])
    x2 = torch.relu(x1 @ t["w2"] + t["b2"])
    return torch.softmax(x2 @ t["w3"] + t["b3"], dim=-1)


def layernorm_linear_gelu(t, m):
    h = F.layer_norm(t["x"], t["x"].shape[-1:], t["g"], t["beta"], eps=1e-5)
    return F.gelu(h @ t["w"] + t["c"], approximate="tanh")


def rmsnorm(t, m):
    return _rms(t["x"], t["g"], 1e-6)


def gemma_rmsnorm(t, m):
    return _rms(t["x"], 1.0 + t["g"], 1e-6) @ t["w"]


def swiglu_mlp(t, m):
    return (F.silu(t["x"] @ t["w_gate"]) * (t["x"] @ t["w_up"])) @ t["w_down"]


def gelu_mlp(t, m):
    return F.gelu(t["x"] @ t["w1"] + t["b1"], approximate="tanh") @ t["w2"] + t["b2"] + t["x"]


def mha_heads(t, m):
    q, k, v = (torch.einsum("bsd,hde->bhse", t["x"], t[w]) for w in ("wq", "wk", "wv"))
    return torch.einsum("bhse,hed->bsd", _softmax_heads(q, k, v), t["wo"])


def cross_attention(t, m):
    q = torch.einsum("btd,hde->bhte", t["x"], t["wq"])
    k, v = (torch.einsum("bsd,hde->bhse", t["memory"], t[w]) for w in ("wk", "wv"))
    return torch.einsum("bhte,hed->btd", _softmax_heads(q, k, v), t["wo"]) + t["x"]


def gpt2_plain(t, m):
    x = t["x"]
    h = F.layer_norm(x, x.shape[-1:], t["ln1_g"], t["ln1_b"], eps=1e-5)
    q, k, v = (torch.einsum("bsd,hde->bhse", h, t[w]) + t[b][:, None, :]
               for w, b in (("wq", "bq"), ("wk", "bk"), ("wv", "bv")))
    att = torch.softmax(q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5 + t["causal"], dim=-1) * m["drop_attn"]
    x = x + (torch.einsum("bhse,hed->bsd", att @ v, t["wo"]) + t["bo"]) * m["drop_res"]
    h2 = F.layer_norm(x, x.shape[-1:], t["ln2_g"], t["ln2_b"], eps=1e-5)
    return x + (F.gelu(h2 @ t["w_fc"] + t["b_fc"], approximate="tanh") @ t["w_out"] + t["b_out"]) * m["drop_mlp"]


def t5_block(t, m):
    x = t["x"]
    h = _rms(x, t["g1"], 1e-6)
    q, k, v = (torch.einsum("bsd,hde->bhse", h, t[w]) for w in ("wq", "wk", "wv"))
    x1 = x + torch.einsum("bhse,hed->bsd", _softmax_heads(q, k, v, scale=False), t["wo"])
    return x1 + torch.relu(_rms(x1, t["g2"], 1e-6) @ t["wi"]) @ t["wf"]


def std_norm(t, m):
    x = t["x"]
    z = (x - x.mean(-1, keepdim=True)) / (x.std(-1, correction=0, keepdim=True) + 1e-3)
    return z * t["g"] + t["b"]


def einsum_implicit(t, m):
    h = torch.einsum("btd,fd->btf", t["x"], t["w"])
    return torch.einsum("btf,fd->btd", torch.tanh(h), t["u"]) + t["x"]


def instance_norm(t, m):
    x = t["x"]
    c = x - x.mean((1, 2), keepdim=True)
    return c / torch.sqrt(c.pow(2).mean((1, 2), keepdim=True) + 1e-5) * t["g"]


def logsoftmax_misc(t, m):
    x, w = t["x"], t["w"]
    logp = torch.log_softmax(x, dim=1)
    leaky = torch.where(logp > -2.0, logp, 0.1 * logp)
    return torch.minimum(leaky / (1 + w.abs()), w ** 2 - 1) - x.amin(dim=-1)[:, None]


def _rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rope_rotate_half(t, m):
    q, k = (torch.einsum("bsd,dhe->bhse", t["x"], t[w]) for w in ("wq", "wk"))
    q = q * t["cos"] + _rotate_half(q) * t["sin"]
    k2 = k * t["cos"] + _rotate_half(k) * t["sin"]
    return torch.einsum("bhse,bhse->bsh", q, k2 + 2.0 * k)


def gqa_repeat(t, m):
    groups = t["wq"].shape[1] // t["wk"].shape[1]
    q = torch.einsum("bsd,dhe->bhse", t["x"], t["wq"])
    k, v = (torch.einsum("btd,dke->bkte", t["x"], t[w]).repeat_interleave(groups, dim=1) for w in ("wk", "wv"))
    return torch.einsum("bhse,hed->bsd", _softmax_heads(q, k, v), t["wo"])


def rope_table_gradient(t, m):
    groups = t["wq"].shape[1] // t["wk"].shape[1]
    q = torch.einsum("bsd,dhe->bhse", t["x"], t["wq"]) * t["sin"]
    k = (torch.einsum("bsd,dke->bkse", t["x"], t["wk"]) * t["sin"]).repeat_interleave(groups, dim=1)
    return torch.einsum("bhse,hed->bsd", q * k, t["wo"])


def _causal_heads(t, window=None):
    q, k, v = (torch.einsum("bsd,dhe->bhse", t["x"], t[w]) for w in ("wq", "wk", "wv"))
    T = q.shape[2]
    scores = (q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5).masked_fill(
        torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    p = torch.softmax(scores, dim=-1)
    if window is not None:
        p = p * (1.0 - torch.ones(T, T, dtype=torch.float64).triu(window))
    return torch.einsum("bhse,hed->bsd", p @ v, t["wo"])


def gqa_groups(t, m):
    q = torch.einsum("bsd,dkge->bkgse", t["x"], t["wq"])
    k, v = (torch.einsum("btd,dke->bkte", t["x"], t[w]) for w in ("wk", "wv"))
    scores = torch.einsum("bkgse,bkte->bkgst", q, k) / q.shape[-1] ** 0.5 + t["causal"]
    context = torch.einsum("bkgst,bkte->bkgse", torch.softmax(scores, dim=-1), v)
    return torch.einsum("bkgse,kged->bsd", context, t["wo"])


def causal_tril(t, m):
    return _causal_heads(t)


def sliding_window(t, m):
    q, k, v = (torch.einsum("bsd,dhe->bhse", t["x"], t[w]) for w in ("wq", "wk", "wv"))
    T = q.shape[2]
    i, j = torch.arange(T)[:, None], torch.arange(T)[None, :]
    scores = (q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5).masked_fill(~((j <= i) & (i - j < 3)), float("-inf"))
    return torch.einsum("bhse,hed->bsd", torch.softmax(scores, dim=-1) @ v, t["wo"])


def causal_arange(t, m):
    return _causal_heads(t, window=3)


def silu_forms(t, m):
    x = t["x"]
    h = _rms(x, t["g"], 1e-6)
    return x + (F.silu(h @ t["w1"]) + F.silu(h @ t["w2"]) + F.silu(h @ t["w3"])) @ t["w_out"]


def helper_einsum_arg(t, m):
    q = torch.einsum("bsd,dhe->bhse", t["h"], t["wq"]) * t["cos"] + t["sin"]
    return torch.einsum("bhse,hed->bsd", torch.tanh(q), t["wo"])


def helper_matmul_twice(t, m):
    x = t["x"]
    gate, up = F.silu(x @ t["w1"]), F.silu(x @ t["w2"])
    return (gate * up) @ t["w3"] + (x @ t["w1"]) @ t["w3"]


def two_axis_reductions(t, m):
    x = t["x"]
    h = torch.tanh(x * t["w"])
    return h.amax(dim=1, keepdim=True) + h.amin(dim=0) - (x * x).sum(dim=0)


def einsum_chain(t, m):
    h = torch.tanh(torch.einsum("btd,de,ef->btf", t["x"], t["w1"], t["w2"]))
    return torch.einsum("btf,f,ef->bte", h, t["v"], t["w2"])


def einsum_summed_letter(t, m):
    scores = torch.tanh(torch.einsum("btd,de->bt", t["x"], t["w"]))
    return scores[:, :, None] * torch.einsum("btd,de->be", t["x"], t["w"])[:, None, :]


def einsum_elementwise(t, m):
    x, g = t["x"], t["g"]
    energy = (x * g * torch.tanh(x)).sum(-1)
    return energy + torch.einsum("btd,btd->bt", x, x * g)


def _gelu_tanh(x):
    return 0.5 * x * (1 + torch.tanh(0.7978845608 * (x + 0.044715 * x ** 3)))


def parallel_block(t, m):
    x = t["x"]
    h = F.layer_norm(x, x.shape[-1:], t["g"], t["beta"], eps=1e-5)
    q = torch.einsum("bsd,dhe->bhse", h, t["wq"]) + t["bq"][:, None, :]
    k, v = h @ t["wk"], h @ t["wv"]
    s = torch.einsum("bhse,bte->bhst", q, k) / q.shape[-1] ** 0.5 + t["rel"]
    p = torch.softmax(torch.tanh(s / 5.0) * 5.0, dim=-1)
    attention = torch.einsum("bhse,hed->bsd", torch.einsum("bhst,bte->bhse", p, v), t["wo"])
    return x + attention + (_gelu_tanh(h @ t["wg"]) * (h @ t["wu"])) @ t["wd"] + t["bd"]

def clip_log1p(t, m):
    x = t["x"]
    h = x @ t["w1"] + t["b1"]
    signed_log = torch.sign(h) * torch.log1p(h.abs())
    e = torch.expm1(h.clamp(max=1.0)) + torch.expm1(h.clamp(max=0.25))
    return (h.clamp(-0.5, 0.75) + signed_log + 0.5 * e) @ t["w2"] + x.clamp(-1.0, 1.25) * 1.5


def qk_norm(t, m):
    x = t["x"]
    q = _rms(torch.einsum("bsd,dhe->bhse", x, t["wq"]), t["gq"], 1e-6)
    k = _rms(torch.einsum("bsd,dhe->bhse", x, t["wk"]), t["gk"], 1e-6)
    v = torch.einsum("bsd,dhe->bhse", x, t["wv"])
    T = x.shape[1]
    scores = (q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5).masked_fill(
        torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    return x + 0.5 * torch.einsum("bhse,hed->bsd", torch.softmax(scores, dim=-1) @ v, t["wo"]) * t["ls"]

CORPUS = {  # spec -> (contractions, normalizations, element-wise operators of the forward pass), torch layer
    "mlp_softmax": ((3, 1, 5), mlp_softmax),  # bias and ReLU each one map; the softmax one operator
    "layernorm_linear_gelu": ((1, 1, 2), layernorm_linear_gelu),  # LN, Linear, bias, GELU
    "rmsnorm": ((0, 1, 1), rmsnorm),  # the square before the first reduction stays element-wise
    "gemma_rmsnorm": ((1, 1, 3), gemma_rmsnorm),  # 1 + g its own map: g's gradient is that map's, copied
    "swiglu_mlp": ((3, 0, 2), swiglu_mlp),  # SiLU one chain, the gate's product another
    "gelu_mlp": ((2, 0, 4), gelu_mlp),
    "attention_transpose": ((6, 1, 3), attention_transpose),  # scale, mask, residual
    "mha_heads": ((6, 1, 1), mha_heads),
    "cross_attention": ((6, 1, 2), cross_attention),  # keys and values from memory, of another length
    "gpt2_plain": ((8, 3, 14), gpt2_plain),
    "t5_block": ((8, 3, 5), t5_block),
    "std_norm": ((0, 1, 0), std_norm),  # mean, std and the affine tail: one normalization
    "einsum_implicit": ((2, 0, 2), einsum_implicit),
    "instance_norm": ((0, 1, 0), instance_norm),
    "logsoftmax_misc": ((0, 2, 6), logsoftmax_misc),  # log-softmax and np.min: two normalizations
    # max over d and min over b of one h, added: the add applies the max only (one reduction set per operator)
    "two_axis_reductions": ((0, 3, 4), two_axis_reductions),
    # rotate_half: one einsum with the front end's constant matrix per rotated tensor, an element-wise
    # operator (a shuffle, dataflow.shuffle); the halves put back in place (np.concatenate((lo, hi))) are k itself
    # its output, a batched dot product (no GEMM), is a product and a sum (``dataflow.einsum_split``)
    "rope_rotate_half": ((2, 1, 11), rope_rotate_half),
    "gqa_repeat": ((8, 1, 1), gqa_repeat),  # np.repeat of K and V: an einsum each with a 0/1 matrix
    "gqa_groups": ((6, 1, 2), gqa_groups),
    "rope_table_gradient": ((4, 0, 3), rope_table_gradient),  # sin's gradient: two reductions, (b, h) and (b, k)  # query heads as (kv head, group): K and V read once
    "causal_tril": ((6, 1, 2), causal_tril),  # np.where(mask == 0, -inf, s): s + an additive constant
    "causal_arange": ((6, 1, 3), causal_arange),
    "sliding_window": ((6, 1, 2), sliding_window),  # a mask of positions, not causal: the attention is not fused
    "silu_forms": ((4, 1, 7), silu_forms),  # each SiLU one chain; the RMSNorm's square stays apart
    "helper_einsum_arg": ((2, 0, 3), helper_einsum_arg),
    "helper_matmul_twice": ((4, 0, 4), helper_matmul_twice),  # x @ w1 computed once, its uses share it
    # ``dataflow.einsum_split``: each einsum two operands, each letter in two of its three terms
    "einsum_chain": ((3, 0, 2), einsum_chain),  # x w1 w2: two GEMMs; h v w2: a product, then a GEMM
    "einsum_summed_letter": ((2, 2, 2), einsum_summed_letter),  # w summed over e, x over t: reductions
    "einsum_elementwise": ((0, 1, 4), einsum_elementwise),  # products; the dot product's sum joins the output's
    # one h read by K/V and by the MLP's gate and up: two stacks' sums in one gradient (d_h), each its own partial
    "parallel_block": ((9, 2, 9), parallel_block),
    # q @ k.T of two results of one helper: k's array was read as q's and q's as k's (DaCe swaps a GEMM's operands
    # for a transposed output; the helper's returned arrays, renamed, matched neither recorded name)
    "qk_norm": ((6, 3, 7), qk_norm),
    # the activation's maps one operator; x clipped (two np.where) and added to the output another
    "clip_log1p": ((2, 0, 4), clip_log1p),
}


@pytest.fixture(scope="module")
def analyses():
    cache = {}

    def get(name):
        if name not in cache:
            cache[name] = analyse_spec(SPECS / f"{name}.py")
        return cache[name]
    return get


def numpy_forward(spec, values: dict) -> np.ndarray:
    """The spec's own function run by NumPy on float64 arrays, its dims bound to their sizes."""
    module_spec = importlib.util.spec_from_file_location(f"plain_{spec.path.stem}", spec.path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    namespace = dict(vars(module), **spec.dim_values)
    for name, value in vars(module).items():  # G = H // KV: an expression of dims, here at their sizes
        if isinstance(value, sympy.Basic) and value.free_symbols:
            namespace[name] = int(value.subs({s: spec.dim_values[str(s)] for s in value.free_symbols}))
    for name, value in vars(module).items():
        if isinstance(value, types.FunctionType) and value.__module__ == module.__name__:
            namespace[name] = types.FunctionType(value.__code__, namespace, name, value.__defaults__)
    return namespace[spec.name](*(values[arg.name] for arg in spec.arguments if not arg.value))  # the spec's own


def test_corpus_covers_every_spec_file():
    assert sorted(p.stem for p in SPECS.glob("*.py")) == sorted(CORPUS) and len(CORPUS) >= 14


@pytest.mark.parametrize("name", CORPUS)
def test_plain_spec_matches_numpy_and_torch(analyses, name):
    analysis = analyses(name)
    (contractions, normalizations, elementwise), layer = CORPUS[name]
    classes = Counter(op.cls for op in analysis.operators)
    assert (classes[CONTRACTION], classes[NORMALIZATION], classes[ELEMENTWISE]) == \
        (contractions, normalizations, elementwise), [(op.cls, op.name) for op in analysis.operators]

    graph, training, fused = analysis.graph, analysis.training, analysis.fused
    values = random_inputs(graph, training, np.random.default_rng(3))
    result = execute(training.graph, values, SEED)
    in_fused = execute(fused.graph, values, SEED, schedule=fused.operators)
    masks = dropout_masks(graph, SEED)
    (out,) = graph.outputs
    expected = numpy_forward(analysis.spec, {**values, **masks})
    assert relative_error(result[out], expected) < 1e-12

    leaves = {n: torch.tensor(values[n], requires_grad=info.role == "input")
              for n, info in graph.tensors.items() if info.role in ("input", "constant") and not info.value}
    y = layer(leaves, {n: torch.tensor(mask) for n, mask in masks.items()})
    assert relative_error(y.detach().numpy(), expected) < 1e-12
    y.backward(torch.tensor(values[training.seeds[out]]))
    grads = {n: leaf.grad.numpy() for n, leaf in leaves.items() if leaf.requires_grad}
    assert set(grads) == set(training.input_grads)
    floor = 1e-5 * max(np.linalg.norm(g) for g in grads.values())  # gradients that vanish exactly (key biases)
    for leaf, grad in grads.items():
        for env in (result, in_fused):
            assert relative_error(env[training.input_grads[leaf]], grad, floor) < 1e-10, leaf


DATA_INPUTS = {"mlp_softmax": ("input",), "cross_attention": ("x", "memory"), "helper_einsum_arg": ("h",),
               "rope_table_gradient": ("x", "sin"), "parallel_block": ("x", "rel")}  # rel: over (h, s, t)  # others: ("x",)


@pytest.mark.parametrize("name", CORPUS)
def test_default_rule_tells_data_from_weights(analyses, name):
    """``dataflow.layer_inputs``: the first argument and those sharing a batch or sequence letter
    with it are data, in the forward graph and in the fused training graph the artifact holds."""
    analysis = analyses(name)
    assert data_inputs(analysis.graph) == data_inputs(analysis.fused.graph) == DATA_INPUTS.get(name, ("x",))


def test_plain_spec_letters_come_from_annotations(analyses):
    """Dims keep the annotations' letters; q @ k.T names the key position with INDEX's other
    letter of the same dim; a transpose moves nothing (no map reads k permuted into a copy)."""
    graph = analyses("attention_transpose").graph
    einsums = [p.expr for p in graph.primitives if p.kind == "einsum"]
    assert einsums == ["sd,de->se"] * 3 + ["se,te->st", "st,te->se", "se,ed->sd"]
    assert all(p.kind != "map" or p.expr != "in0" for p in graph.primitives)
    assert graph.tensors["y"].letters == "sd"


def test_a_parameter_read_through_an_identity_has_its_own_gradient(tmp_path, capsys):
    """Gemma's (1 + g): the gradient of g is the gradient of 1 + g, which autodiff aliases; the
    training graph still names it d_g (a copy), so the layer exports (it stopped at "the training
    graph has no gradient tensor 'd_g'"), g starts at 0 (the identity) and the layer's output and
    gradients match torch's in float64."""
    from datamove.cli import main
    from datamove.export import load_layer

    out = tmp_path / "gemma"
    assert main([str(SPECS / "gemma_rmsnorm.py"), "--out", str(out)]) == 0
    capsys.readouterr()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        layer = load_layer(out, device="cpu", dtype=torch.float64, allow_mismatch=True)
    assert layer.interface.input_grads["g"] == "d_g" and torch.equal(layer.g, torch.zeros(7, dtype=torch.float64))
    gen = torch.Generator().manual_seed(4)
    with torch.no_grad():
        layer.g.copy_(torch.randn(7, generator=gen, dtype=torch.float64))
    x = torch.randn(3, 5, 7, generator=gen, dtype=torch.float64, requires_grad=True)
    theirs = {n: layer.spec_view(n).detach().clone().requires_grad_() for n in ("g", "w")}
    dy = torch.randn(3, 5, 6, generator=gen, dtype=torch.float64)
    y = layer(x)
    expected = gemma_rmsnorm({"x": x, **theirs}, None)
    torch.testing.assert_close(y, expected)
    (mine_x, mine_g, mine_w) = torch.autograd.grad(y, [x, layer.g, layer.w], dy)
    (ref_x, ref_g, ref_w) = torch.autograd.grad(expected, [x, theirs["g"], theirs["w"]], dy)
    torch.testing.assert_close(mine_x, ref_x)
    torch.testing.assert_close(layer.spec_view("g", mine_g), ref_g)
    torch.testing.assert_close(layer.spec_view("w", mine_w), ref_w)


@pytest.mark.parametrize("name", ["logsoftmax_misc", "two_axis_reductions"])
# the kernels (through the Triton interpreter) compute in float32; the torch backend in float64 (its where(c, 1, 0.1),
# the leaky ReLU's gradient, was taken in float32, 4e-10 off)
@pytest.mark.parametrize("backend, dtype, tolerance", [("torch", torch.float64, 1e-13), ("kernels", torch.float32, 2e-5)])
def test_a_tensor_reduced_over_two_axes_exports_and_computes(tmp_path, capsys, name, backend, dtype, tolerance):
    """One tensor reduced over each of its axes (a log-softmax over d and np.min over d of x beside
    w's gradient summed over b from two tensors; np.max over d and np.min over b of one h): the job
    writes a plan (its export stopped at "reductions over different letter sets ... a bug in
    datamove's selection"), and the layer's output and gradients match torch's in float64 at other
    odd dims (errors relative to the reference's norm; the same values given to both)."""
    from datamove.cli import main
    from datamove.export import load_layer

    out = tmp_path / name
    assert main([str(SPECS / f"{name}.py"), "--dims", "B=9,D=11", "--out", str(out)]) == 0
    capsys.readouterr()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        layer = load_layer(out, device="cpu", dtype=dtype, backend=backend, allow_mismatch=True)
    assert layer.interface.torch_order["x"] == "bd"
    gen = torch.Generator().manual_seed(13)
    with torch.no_grad():
        layer.w.copy_(torch.randn(11, generator=gen, dtype=torch.float64))
    x = torch.randn(9, 11, generator=gen, dtype=torch.float64).to(dtype).requires_grad_()
    w = layer.spec_view("w").detach().double().requires_grad_()
    x64 = x.detach().double().requires_grad_()
    y, expected = layer(x), CORPUS[name][1]({"x": x64, "w": w}, None)
    dy = torch.randn(y.shape, generator=gen, dtype=torch.float64)
    mine_x, mine_w = torch.autograd.grad(y, [x, layer.w], dy.to(dtype))
    ref_x, ref_w = torch.autograd.grad(expected, [x64, w], dy)
    for result, reference in ((y, expected), (mine_x, ref_x), (layer.spec_view("w", mine_w), ref_w)):
        assert relative_error(result.detach().double().numpy(), reference.detach().numpy()) < tolerance


def _float64_layer_against_torch(out, name: str, seed: int):
    """The artifact ``out``'s layer of corpus spec ``name`` in float64 on the CPU, its weights drawn
    N(0, 1) from ``seed``, on a random ``x``: its output and the gradients of ``x`` and of every
    weight equal to torch's of ``CORPUS[name]``'s function; -> (x, the weights as torch leaves, output)."""
    from datamove.export import load_layer

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        layer = load_layer(out, device="cpu", dtype=torch.float64, allow_mismatch=True)
    gen = torch.Generator().manual_seed(seed)
    weights = list(layer.interface.parameters)
    with torch.no_grad():
        for n in weights:
            getattr(layer, n).copy_(torch.randn(getattr(layer, n).shape, generator=gen, dtype=torch.float64))
    shape = tuple(layer.graph.size(letter) for letter in layer.interface.torch_order["x"])
    x = torch.randn(shape, generator=gen, dtype=torch.float64, requires_grad=True)
    theirs = {n: layer.spec_view(n).detach().clone().requires_grad_() for n in weights}
    y, expected = layer(x), CORPUS[name][1]({"x": x, **theirs}, None)
    torch.testing.assert_close(y, expected)
    dy = torch.randn(y.shape, generator=gen, dtype=torch.float64)
    mine = torch.autograd.grad(y, [x, *(getattr(layer, n) for n in weights)], dy)
    ref = torch.autograd.grad(expected, [x, *theirs.values()], dy)
    torch.testing.assert_close(mine[0], ref[0])
    for n, g, r in zip(weights, mine[1:], ref[1:]):
        torch.testing.assert_close(layer.spec_view(n, g), r)
    return x, theirs, y


@pytest.mark.parametrize("name", ["einsum_chain", "einsum_summed_letter", "einsum_elementwise"])
def test_einsums_that_are_no_gemm_export_a_layer(tmp_path, capsys, analyses, name):
    """Three operands, a letter one operand alone has summed, a product without a summed letter
    feeding a reduction (``dataflow.einsum_split``): the job runs (they stopped in the GEMM's parse,
    in autodiff and at "operators without a candidate"), and the layer's output in float64 is
    NumPy's, its gradients torch.autograd's."""
    from datamove.cli import main

    out = tmp_path / name
    assert main([str(SPECS / f"{name}.py"), "--out", str(out)]) == 0
    capsys.readouterr()
    x, theirs, y = _float64_layer_against_torch(out, name, seed=4)
    numpy_values = {"x": x.detach().numpy(), **{n: w.detach().numpy() for n, w in theirs.items()}}
    assert relative_error(y.detach().numpy(), numpy_forward(analyses(name).spec, numpy_values)) < 1e-12


@pytest.mark.parametrize("name", CORPUS)
def test_the_main_job_exports_every_plain_spec(tmp_path, capsys, name):
    """The main job on each spec of the corpus writes its artifact (whose plans were run forward and
    backward before writing, ``runtime.runnable``): three of them once stopped in the selection or
    the GEMM's parse (``helper_matmul_twice``: ``x @ w1`` twice, stacked with one tensor twice)."""
    from datamove.cli import main

    assert main([str(SPECS / f"{name}.py"), "--out", str(tmp_path / name)]) == 0, capsys.readouterr().out[-2000:]
    assert (tmp_path / name / "manifest.json").is_file()


def test_analyze_command_on_a_plain_spec(tmp_path, capsys):
    from datamove.cli import main

    out = tmp_path / "gpt2_plain.json"
    assert main([str(SPECS / "gpt2_plain.py"), "--analyze", "--dims", "B=3,T=7", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "contraction" in text and "normalization" in text
    assert '"class": "contraction"' in out.read_text()


# --- what the constructs of Llama-style layers lower to ---------------------------------------------

def _rotate_half_np(x):
    half = x.shape[-1] // 2
    return np.concatenate((-x[..., half:], x[..., :half]), axis=-1)


def test_rotate_half_is_one_einsum_with_a_matrix_the_graph_knows(analyses):
    """rotate_half (x[..., :half], x[..., half:], np.concatenate((-x2, x1))) is one einsum reading the
    rotated tensor through a constant argument ``concat_e`` whose value the graph carries, the sign
    in the matrix (no negation map); that value is NumPy's rotate_half at every head dim, odd ones
    included (the spec's E = 5, and E = 8 through with_dims); the halves put back in their places
    (np.concatenate((lo, hi))) are no einsum at all."""
    graph = analyses("rope_rotate_half").graph
    info = graph.tensors["concat_e"]
    assert info.role == "constant" and info.value and info.letters[1] == "e" and graph.letter_dims[info.letters[0]] == "E"
    readers = [p for p in graph.primitives if any(o.tensor == "concat_e" for o in p.inputs)]
    assert [p.expr for p in readers] == [f"bhs{info.letters[0]},{info.letters}->bhse"] * 2
    assert not any(p.kind == "map" and p.expr.startswith("-") for p in graph.primitives)
    assert [p.kind for p in graph.primitives].count("einsum") == 4  # q, k, two rotations (the output: a product)
    rng = np.random.default_rng(0)
    for g in (graph, graph.with_dims({**graph.dim_values, "E": 8})):
        x = rng.standard_normal((3, g.dim_values["E"]))
        assert np.array_equal(x @ known_value(g, "concat_e"), _rotate_half_np(x))


def test_repeat_is_an_einsum_with_the_repetition_matrix(analyses):
    """np.repeat(k, H // KV, axis=1) (and k.repeat(G, axis=1), G = H // KV) reads K and V over the
    query heads h through one 0/1 matrix over (k, h): NumPy's np.repeat of the identity."""
    graph = analyses("gqa_repeat").graph
    made = [t for t, info in graph.tensors.items() if info.value]
    assert made == ["repeat_kh"] and graph.tensors["repeat_kh"].letters == "kh"
    assert [p.expr for p in graph.primitives if any(o.tensor == "repeat_kh" for o in p.inputs)] == ["bkte,kh->bhte"] * 2
    kv, h = graph.dim_values["KV"], graph.dim_values["H"]
    assert np.array_equal(known_value(graph, "repeat_kh"), np.repeat(np.eye(kv), h // kv, axis=1))


@pytest.mark.parametrize("name, mask", [("causal_tril", "mask"), ("causal_arange", "bias")])
def test_causal_mask_built_in_the_layer_is_the_causal_mask_the_attention_replaces(analyses, name, mask):
    """A mask from np.tril(np.ones((T, T))) through np.where(keep == 0, -inf, s), or from
    np.arange(T)[:, None] >= np.arange(T)[None, :] through np.where(.., 0, -inf) added, is an additive
    constant over (s, t) added to the scores: initial_values reads it as the CausalMask, the fused
    attention takes it in the constant's place; a multiplicative window stays a KnownValue."""
    from datamove.families.attention import attention_roles
    from datamove.job import fused_training

    analysis = analyses(name)
    graph = analysis.fused.graph
    constants = [t for t, info in graph.tensors.items() if info.role == "constant"]
    kinds = initial_values(graph, [], constants)
    assert kinds[mask] == CausalMask(rows="s", keys="t")
    value = known_value(graph, mask)
    s, t = np.indices(value.shape)
    assert np.array_equal(value, np.where(t <= s, 0.0, -np.inf))
    roles, why = attention_roles(fused_training(analysis).with_dims({"E": 16}))  # a head dim it takes
    if name == "causal_arange":  # the window multiplies the probabilities: the softmax reads it too
        assert isinstance(kinds["recent"], KnownValue)
        assert np.array_equal(known_value(graph, "recent"), np.where(t - s >= 3, 0.0, 1.0))
        assert roles is None and "reads ['q_k', 'recent']" in why, why
    else:
        assert roles is not None and roles.causal == mask, why


def test_a_sliding_window_mask_is_not_taken_for_the_causal_mask(analyses):
    """Mistral's sliding window (np.where of position comparisons) is an additive constant over (s, t)
    added to the scores, as a causal mask is, but of another value: it keeps that value
    (``KnownValue``) and the fused attention, which applies only a causal mask, is not used, with
    the reason given (it was taken, and the layer then refused to run unless the constant was
    overwritten with the causal mask)."""
    from datamove.families.attention import attention_roles
    from datamove.job import fused_training

    analysis = analyses("sliding_window")
    graph = analysis.fused.graph
    (mask,) = [t for t, info in graph.tensors.items() if info.role == "constant" and len(info.letters) == 2]
    assert isinstance(initial_values(graph, [], [mask])[mask], KnownValue)
    s, t = np.indices((graph.size("s"), graph.size("t")))
    assert np.array_equal(known_value(graph, mask), np.where((t <= s) & (s - t < 3), 0.0, -np.inf))
    roles, why = attention_roles(fused_training(analysis).with_dims({"E": 16}))
    assert roles is None and "holds a mask that is not causal" in why, why
    causal, why = attention_roles(fused_training(analyses("causal_tril")).with_dims({"E": 16}))
    assert causal is not None, why


def test_group_letter_attention_is_not_fused_for_the_right_reason(analyses):
    from datamove.families.attention import attention_roles
    from datamove.job import fused_training

    roles, why = attention_roles(fused_training(analyses("gqa_groups")))
    assert roles is None and why.startswith("the scores carry two head letters, k and g (grouped-query attention"), why


def test_known_values_survive_the_snapshot(analyses):
    """graph.json (``dataflow.snapshot``) keeps a made constant's value; a tensor without one is
    written as before (BERT's and GPT-2's snapshots unchanged)."""
    graph = analyses("rope_rotate_half").fused.graph
    data = json.loads(json.dumps(snapshot.snapshot(graph, [])))
    assert len(data["tensors"]["concat_e"]) == 4 and len(data["tensors"]["cos"]) == 3
    loaded, _ = snapshot.load(data)
    assert loaded.tensors["concat_e"] == graph.tensors["concat_e"]
    assert np.array_equal(known_value(loaded, "concat_e"), known_value(graph, "concat_e"))


def test_helpers_with_contractions_are_inlined(analyses):
    """Two calls of a helper containing @ get their own einsums (once both results shared one name
    and the first lost its producer); an einsum passed straight into a helper is named first."""
    graph = analyses("helper_matmul_twice").graph
    einsums = [(p.inputs[1].tensor, p.output.tensor) for p in graph.primitives if p.kind == "einsum"]
    assert [w for w, _ in einsums] == ["w1", "w2", "w3", "w3"] and len({out for _, out in einsums}) == 4
    graph = analyses("helper_einsum_arg").graph
    (projection,) = [p for p in graph.primitives if p.kind == "einsum" and p.inputs[1].tensor == "wq"]
    assert graph.consumers()[projection.output.tensor]


MASK_HEADER = '''
import numpy as np
from datamove.dataflow.spec import Tensor, dims
B, T, E = dims(B=2, T=5, E=4)
INDEX = {"b": B, "s": T, "t": T, "e": E}


def layer(q: Tensor("bse"), k: Tensor("bte"), v: Tensor("bte")):
    s = q @ np.swapaxes(k, 1, 2)
'''


@pytest.mark.parametrize("masking", [
    "s = s + np.triu(np.full((T, T), float('-inf')), 1)",
    "s = np.where(np.tril(np.ones((T, T), dtype=bool)), s, np.finfo(np.float32).min)",
    "s = np.where(np.arange(T)[None, :] > np.arange(T)[:, None], -np.inf, s)",
    "s = s + np.triu(np.ones((T, T)), k=1) * -1e9",
    "s = s + np.where(np.tril(np.ones((T, T))).astype(bool), 0.0, -np.inf)",
])
def test_causal_mask_spellings(tmp_path, masking):
    """The ways a causal mask is written in NumPy each become one additive constant over (s, t) of
    known value, which initial_values reads as the causal mask."""
    from datamove.dataflow.pipeline import forward_graph

    path = tmp_path / "masked.py"
    path.write_text(MASK_HEADER + f"    {masking}\n    p = np.exp(s - s.max(-1, keepdims=True))\n"
                    "    return (p / p.sum(-1, keepdims=True)) @ v\n")
    _, graph = forward_graph(path)
    (mask,) = [t for t, info in graph.tensors.items() if info.value]
    assert graph.tensors[mask].letters == "st"
    assert initial_values(graph, [], [mask]) == {mask: CausalMask(rows="s", keys="t")}


REASSIGNED = '''
import numpy as np
from datamove.dataflow.spec import Tensor, dims
B, T, D = dims(B=3, T=5, D=7)
INDEX = {"b": B, "s": T, "d": D, "c": D}
OPTIONS = {"act": ("relu", "tanh")}
ACT = "relu"


def layer(x: Tensor("bsd"), w: Tensor("dc")):
    h = x @ w
    if ACT == "tanh":
        h = np.tanh(h)
    else:
        h = np.maximum(h, 0.0)
    return h
'''


@pytest.mark.parametrize("act, torch_act", [("relu", torch.relu), ("tanh", torch.tanh)])
def test_an_output_named_like_an_earlier_value_is_the_last_value(tmp_path, act, torch_act):
    """``h = x @ w; h = f(h); return h`` (f chosen by an option): the output h is f's result and the
    first h a tensor of its own (both were named h_1, the einsum's output read and written by f's
    map, and the backward stopped in a KeyError on 'h'); output and gradients are torch's."""
    path = tmp_path / "reassigned.py"
    path.write_text(REASSIGNED)
    analysis = analyse_spec(path, options={"act": act})
    graph, training = analysis.graph, analysis.training
    assert graph.outputs == ["h"] and len({p.output.tensor for p in graph.primitives}) == 2
    values = random_inputs(graph, training, np.random.default_rng(5))
    result = execute(training.graph, values, SEED)
    x, w = (torch.tensor(values[n], requires_grad=True) for n in ("x", "w"))
    y = torch_act(x @ w)
    assert relative_error(result["h"], y.detach().numpy()) < 1e-12
    y.backward(torch.tensor(values[training.seeds["h"]]))
    for leaf, grad in (("x", x.grad), ("w", w.grad)):
        assert relative_error(result[training.input_grads[leaf]], grad.numpy()) < 1e-12, leaf


@pytest.mark.parametrize("name", ["mha_heads", "einsum_implicit"])
def test_sequence_length_one_exports_and_computes(tmp_path, capsys, name):
    """T = 1: the selection names layouts with their letters of size 1 outermost ('stbh', the storage
    of 'bhst'; 'tbd', that of 'btd').  The scores' GEMM plan now places those letters where cuBLAS
    takes the call (the job stopped at "a batch letter is innermost in an operand ... a bug in
    datamove's selection"), and a GEMM adding a residual compares only the strides of dims of size > 1
    (it stopped at "the residual x is stored (7, 7, 1), its output (7, 21, 1)").  The layer's output
    and gradients are torch's in float64."""
    from datamove.cli import main

    out = tmp_path / name
    assert main([str(SPECS / f"{name}.py"), "--dims", "T=1", "--out", str(out)]) == 0, capsys.readouterr().err
    capsys.readouterr()
    _float64_layer_against_torch(out, name, seed=6)


@pytest.fixture(scope="module")
def clip_log1p_artifact(tmp_path_factory):
    """The main job's artifact of ``clip_log1p`` at other odd dims (B=5, F=11), built once."""
    from datamove.cli import main

    out = tmp_path_factory.mktemp("clip_log1p") / "out"
    assert main([str(SPECS / "clip_log1p.py"), "--dims", "B=5,F=11", "--out", str(out)]) == 0
    return out


# the kernels (through the Triton interpreter) compute in float32; the torch backend in float64
@pytest.mark.parametrize("backend, dtype, tolerance", [("torch", torch.float64, 1e-13), ("kernels", torch.float32, 2e-5)])
def test_clip_log1p_expm1_sign_export_and_compute(clip_log1p_artifact, capsys, backend, dtype, tolerance):
    """np.clip (two bounds; the lower None; x.clip(max=...)), np.log1p, np.expm1 and np.sign (all refused
    before: "np.log1p is not supported"): the layer's output and the gradients of x and every weight are
    torch's (clamp, log1p, expm1, sign) in float64, through the generated kernels and the torch backend.
    The activation's input lands on both sides of every bound; x holds elements on its own clip's bounds
    (-1 and 1.25), where the gradient is 1, as torch.clamp's (errors relative to the reference's norm)."""
    from datamove.export import load_layer

    capsys.readouterr()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        layer = load_layer(clip_log1p_artifact, device="cpu", dtype=dtype, backend=backend, allow_mismatch=True)
    gen = torch.Generator().manual_seed(17)
    weights = list(layer.interface.parameters)
    assert sorted(weights) == ["b1", "w1", "w2"]
    with torch.no_grad():
        for n in weights:
            getattr(layer, n).copy_(torch.randn(getattr(layer, n).shape, generator=gen, dtype=torch.float64))
    x64 = torch.randn(5, 5, 7, generator=gen, dtype=torch.float64)
    x64.view(-1)[::9] = -1.0
    x64.view(-1)[4::9] = 1.25
    x64.requires_grad_()
    x = x64.detach().to(dtype).requires_grad_()
    theirs = {n: layer.spec_view(n).detach().double().requires_grad_() for n in weights}
    h = (x64 @ theirs["w1"] + theirs["b1"]).detach()
    for bound in (-0.5, 0.75, 1.0, 0.25):
        assert (h < bound).sum() > 20 and (h > bound).sum() > 20, bound
    y, expected = layer(x), clip_log1p({"x": x64, **theirs}, None)
    dy = torch.randn(y.shape, generator=gen, dtype=torch.float64)
    mine = torch.autograd.grad(y, [x, *(getattr(layer, n) for n in weights)], dy.to(dtype))
    ref = torch.autograd.grad(expected, [x64, *theirs.values()], dy)
    pairs = [(y, expected), (mine[0], ref[0])] + [(layer.spec_view(n, g), r) for n, g, r in zip(weights, mine[1:], ref[1:])]
    for result, reference in pairs:
        assert relative_error(result.detach().double().numpy(), reference.detach().numpy()) < tolerance


CLIPPED_BY_KEYWORD = '''
import numpy as np
from datamove.dataflow.spec import Tensor, dims
B, T, D = dims(B=3, T=5, D=7)
INDEX = {"b": B, "s": T, "d": D, "c": D}


def layer(x: Tensor("bsd"), w: Tensor("dc")):
    return np.clip(a=x @ w, a_min=-0.5, a_max=0.75)
'''


def test_np_clip_takes_its_array_by_keyword(tmp_path):
    """``np.clip(a=x, a_min=lo, a_max=hi)``, NumPy's keyword for the array (the lowering read
    ``node.args[0]`` and stopped in an IndexError): output and gradients are torch.clamp's."""
    path = tmp_path / "clipped.py"
    path.write_text(CLIPPED_BY_KEYWORD)
    analysis = analyse_spec(path)
    graph, training = analysis.graph, analysis.training
    (out,) = graph.outputs
    values = random_inputs(graph, training, np.random.default_rng(7))
    result = execute(training.graph, values, SEED)
    x, w = (torch.tensor(values[n], requires_grad=True) for n in ("x", "w"))
    y = (x @ w).clamp(-0.5, 0.75)
    assert 0 < int((y.abs() < 0.5).sum()) < y.numel()  # both sides of the bounds
    assert relative_error(result[out], y.detach().numpy()) < 1e-12
    y.backward(torch.tensor(values[training.seeds[out]]))
    for leaf, grad in (("x", x.grad), ("w", w.grad)):
        assert relative_error(result[training.input_grads[leaf]], grad.numpy()) < 1e-12, leaf
