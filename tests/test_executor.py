"""The reference executor on the training graphs agrees with torch.autograd in float64.

Each spec gets an equivalent torch layer written here from torch's own operators (softmax,
layer_norm, relu, gelu), independently of our graphs; it receives the same parameters, the same
incoming gradient and the dropout masks the executor regenerates from (seed, offset).  Small odd
dims; every input's gradient is compared.
"""
import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from datamove.dataflow.autodiff import build_training_graph
from datamove.dataflow.dropout_mask import DECISION_GROUP, dropout_scale_mask
from datamove.dataflow.executor import dropout_masks, dropout_offsets, execute, tensor_shape
from datamove.dataflow.fusion import fuse
from datamove.dataflow.pipeline import forward_graph

warnings.filterwarnings("ignore", module="dace")

BERT_DIMS = dict(B=2, L=5, N=12, H=3, P=4, U=7)
GPT2_DIMS = dict(B=2, T=5, D=12, H=3, E=4, F=7)
SEED = 0x5EED_1234


def bert_torch(t, m, activation):
    """BERT encoder layer (post-LN), tensors in the spec's letter orders; returns y[i, b, j]."""
    x = t["x"]
    P = t["wq"].shape[0]

    def layernorm(z, gamma, beta):  # over i (axis 0)
        return F.layer_norm(z.permute(1, 2, 0), z.shape[:1], gamma, beta, eps=1e-12).permute(2, 0, 1)

    q = torch.einsum("phi,ibj->phbj", t["wq"], x) + t["bq"][:, :, None, None]
    k = torch.einsum("phi,ibk->phbk", t["wk"], x) + t["bk"][:, :, None, None]
    v = torch.einsum("whi,ibk->whbk", t["wv"], x) + t["bv"][:, :, None, None]
    probs = torch.softmax(torch.einsum("phbk,phbj->hbjk", k, q) / P ** 0.5, dim=3)
    gamma = torch.einsum("whbk,hbjk->whbj", v, probs * m["drop_attn"])
    attn = torch.einsum("whi,whbj->ibj", t["wo"], gamma) + t["bo"][:, None, None]
    x1 = layernorm(attn * m["drop_attn_out"] + x, t["ln1_gamma"], t["ln1_beta"])
    pre = torch.einsum("ui,ibj->ubj", t["w1"], x1) + t["b1"][:, None, None]
    act = F.gelu(pre, approximate="tanh") if activation == "gelu" else torch.relu(pre)
    ffn = torch.einsum("iu,ubj->ibj", t["w2"], act * m["drop_act"]) + t["b2"][:, None, None]
    return layernorm(ffn * m["drop_ffn_out"] + x1, t["ln2_gamma"], t["ln2_beta"])


def gpt2_torch(t, m, activation=None):
    """GPT-2 block (pre-LN, causal through the additive mask), tensors [b, s, d]; returns y."""
    x = t["x"]
    E = t["wq"].shape[2]
    h1 = F.layer_norm(x, x.shape[2:], t["ln1_gain"], t["ln1_bias"], eps=1e-5)
    q = torch.einsum("bsd,dhe->bhse", h1, t["wq"]) + t["bq"][None, :, None, :]
    k = torch.einsum("btd,dhe->bhte", h1, t["wk"]) + t["bk"][None, :, None, :]
    v = torch.einsum("btd,dhe->bhte", h1, t["wv"]) + t["bv"][None, :, None, :]
    logits = torch.einsum("bhse,bhte->bhst", q, k) / E ** 0.5 + t["causal"]
    context = torch.einsum("bhst,bhte->bhse", torch.softmax(logits, dim=3) * m["drop_probs"], v)
    x1 = x + (torch.einsum("bhse,hed->bsd", context, t["wproj"]) + t["bproj"]) * m["drop_attn"]
    h2 = F.layer_norm(x1, x1.shape[2:], t["ln2_gain"], t["ln2_bias"], eps=1e-5)
    up = F.gelu(torch.einsum("bsd,df->bsf", h2, t["wfc"]) + t["bfc"], approximate="tanh")
    return x1 + (torch.einsum("bsf,fd->bsd", up, t["wout"]) + t["bout"]) * m["drop_mlp"]


SPECS = {
    "bert": ("configs/bert.py", BERT_DIMS, None, bert_torch),
    "bert-gelu": ("configs/bert.py", BERT_DIMS, {"activation": "gelu"}, bert_torch),
    "gpt2": ("configs/gpt2.py", GPT2_DIMS, None, gpt2_torch),
}


@pytest.fixture(scope="module")
def graphs():
    """Per spec: forward graph, training graph, fused graph (built once)."""
    result = {}
    for key, (path, dims, options, _) in SPECS.items():
        _, graph = forward_graph(path, dims, options)
        training = build_training_graph(graph)
        result[key] = (graph, training, fuse(training))
    return result


def random_inputs(graph, training, rng):
    """Fresh random values for every input, the causal mask, and the incoming gradients (a constant
    the front end made with a known value is left to the executor)."""
    values = {}
    for name, info in graph.tensors.items():
        shape = tensor_shape(graph, name)
        if info.role == "input":
            values[name] = 0.5 * rng.standard_normal(shape)
        elif info.role == "constant" and not info.value and len(set(shape)) == 1 and len(shape) == 2:
            s, t = np.indices(shape)  # the causal mask [s, t]
            values[name] = np.where(t <= s, 0.0, -1e4)
        elif info.role == "constant" and not info.value:  # another constant (RoPE's cos and sin)
            values[name] = rng.uniform(-1.0, 1.0, shape)
    for out, seed in training.seeds.items():
        values[seed] = rng.standard_normal(tensor_shape(graph, out))
    return values


def torch_reference(key, graph, training, values, masks):
    """Forward output and the gradient of every input, from torch.autograd in float64."""
    _, _, options, layer = SPECS[key]
    leaves = {name: torch.tensor(values[name], requires_grad=graph.tensors[name].role == "input")
              for name, info in graph.tensors.items() if info.role in ("input", "constant")}
    out_name = graph.outputs[0]
    y = layer(leaves, {name: torch.tensor(mask) for name, mask in masks.items()},
              (options or {}).get("activation", "relu"))
    y.backward(torch.tensor(values[training.seeds[out_name]]))
    grads = {name: leaf.grad.numpy() for name, leaf in leaves.items() if leaf.requires_grad}
    return y.detach().numpy(), grads


def test_relu_mask_from_output_is_exact(graphs):
    """BERT's ReLU + dropout backward reading hidden instead of pre_act and the mask
    (``dataflow.autodiff.relu_masks_from_outputs``) gives the very gradients of the derivation
    that reads them, with dropout on and off (``p=0``: masks of ones, keep factor 1); that they
    match torch.autograd is ``test_training_graph_matches_torch_autograd``."""
    graph, training, _ = graphs["bert"]
    plain = build_training_graph(graph, relu_masks=False)
    assert "pre_act" in {op.tensor for p in plain.graph.primitives for op in p.inputs if plain.phases[p.name] == "backward"}
    assert "pre_act" not in {op.tensor for p in training.primitives("backward") for op in p.inputs}
    values = random_inputs(graph, training, np.random.default_rng(11))
    for p in (None, 0.0):
        ours, theirs = execute(training.graph, values, SEED, p), execute(plain.graph, values, SEED, p)
        for name, grad in training.input_grads.items():
            np.testing.assert_array_equal(ours[grad], theirs[plain.input_grads[name]], err_msg=name)


def relative_error(a, b, floor=0.0):
    """||a - b|| / ||b||; ``floor`` bounds the denominator below for gradients that vanish in
    exact arithmetic (BERT's and GPT-2's key bias: softmax is shift-invariant along each query)."""
    return np.linalg.norm(a - b) / max(np.linalg.norm(b), floor)


@pytest.mark.parametrize("fused", [False, True], ids=["unfused", "fused"])
@pytest.mark.parametrize("p", [None, 0.0], ids=["dropout", "no-dropout"])
@pytest.mark.parametrize("key", list(SPECS))
def test_training_graph_matches_torch_autograd(graphs, key, p, fused):
    graph, training, fused_graph = graphs[key]
    values = random_inputs(graph, training, np.random.default_rng(7))
    if fused:
        result = execute(fused_graph.graph, values, SEED, p, schedule=fused_graph.operators)
    else:
        result = execute(training.graph, values, SEED, p)
    masks = dropout_masks(graph, SEED, p)
    if p is None:  # dropout really drops something at these sizes
        assert all((mask == 0).any() for mask in masks.values())
    else:
        assert all((mask == 1).all() for mask in masks.values())
    y, grads = torch_reference(key, graph, training, values, masks)
    out = graph.outputs[0]
    assert relative_error(result[out], y) < 1e-10
    assert set(grads) == set(training.input_grads)
    floor = 1e-6 * max(np.linalg.norm(grad) for grad in grads.values())
    for name, grad in grads.items():
        assert relative_error(result[training.input_grads[name]], grad, floor) < 1e-10, name


@pytest.mark.parametrize("key", ["bert", "gpt2"])
def test_generic_chain_rule_agrees_with_closed_forms(graphs, key):
    """Normalizations differentiated through max/exp/sum/div give the same gradients."""
    graph, training, _ = graphs[key]
    generic = build_training_graph(graph, closed_forms=False)
    assert len(generic.primitives("backward")) > len(training.primitives("backward"))
    values = random_inputs(graph, training, np.random.default_rng(11))
    a, b = execute(training.graph, values, SEED), execute(generic.graph, values, SEED)
    floor = 1e-6 * max(np.linalg.norm(a[grad]) for grad in training.input_grads.values())
    for name, grad in training.input_grads.items():
        assert relative_error(b[generic.input_grads[name]], a[grad], floor) < 1e-10, name


def test_dropout_masks_follow_the_seed_offset_convention(graphs):
    graph, training, _ = graphs["bert"]
    offsets = dropout_offsets(graph)
    names = [name for name, info in graph.tensors.items() if info.role == "dropout"]
    assert list(offsets) == names and offsets[names[0]] == 0
    for before, after in zip(names, names[1:]):
        size = graph.size(graph.tensors[before].letters)  # odd test dims: rounded up to whole Philox calls
        assert offsets[after] == offsets[before] + size + (-size) % DECISION_GROUP
        assert offsets[after] % DECISION_GROUP == 0
    result = execute(training.graph, random_inputs(graph, training, np.random.default_rng(3)), SEED)
    mask = dropout_scale_mask(SEED, offsets["drop_attn"], tensor_shape(graph, "drop_attn"), 0.1)
    np.testing.assert_array_equal(result["drop_attn"], mask)
    np.testing.assert_allclose(result["alpha"], result["probs"] * mask, rtol=0, atol=0)
    backward_mask_users = [p for p in training.primitives("backward") if any(op.tensor == "drop_attn" for op in p.inputs)]
    assert [p.expr for p in backward_mask_users] == ["in0 * in1"]  # the backward reuses the forward mask


def test_schedule_must_respect_dependencies(graphs):
    graph, training, _ = graphs["bert"]
    values = random_inputs(graph, training, np.random.default_rng(5))

    class Op:
        def __init__(self, prims):
            self.primitives = prims

    backwards = [Op([p]) for p in reversed(training.graph.primitives)]
    with pytest.raises(KeyError, match="not computed yet"):
        execute(training.graph, values, SEED, schedule=backwards)
