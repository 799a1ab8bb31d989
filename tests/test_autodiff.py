"""Backward derivation: contraction gradients, chain rule on map expressions, closed-form
normalizations recognised from structure, gradient accumulation, flop of the training graph."""
import textwrap
import warnings

import numpy as np
import pytest

from datamove.dataflow.autodiff import BACKWARD, FORWARD, build_training_graph
from datamove.dataflow.expression import parse
from datamove.dataflow.executor import execute, run_primitive, tensor_shape
from datamove.dataflow.fusion import fuse
from datamove.dataflow.operators import CONTRACTION, ELEMENTWISE, NORMALIZATION, primitive_flop
from datamove.dataflow.pipeline import forward_graph

warnings.filterwarnings("ignore", module="dace")

BERT_DIMS = dict(B=2, L=5, N=12, H=3, P=4, U=7)


@pytest.fixture(scope="module")
def bert():
    _, graph = forward_graph("configs/bert.py", BERT_DIMS)
    return graph, build_training_graph(graph)


@pytest.fixture(scope="module")
def bert_large():
    """At the spec's own (BERT-large) dims: counts only, nothing is executed."""
    _, graph = forward_graph("configs/bert.py")
    return graph, build_training_graph(graph)


def test_every_forward_contraction_has_dx_and_dw(bert):
    graph, training = bert
    backward = {p.name: p for p in training.primitives(BACKWARD)}
    for prim in graph.primitives:
        if prim.kind != "einsum":
            continue
        ins, out = prim.expr.split("->")
        terms = ins.split(",")
        expected = {",".join(out if j == k else t for j, t in enumerate(terms)) + "->" + terms[k]
                    for k in range(len(terms))}  # every operand here carries a gradient
        derived = {backward[name].expr for name in training.derived[prim.name] if backward[name].kind == "einsum"}
        assert derived == expected, prim.name
    wq_x = next(p for p in graph.primitives if p.expr == "phi,ibj->phbj")
    assert {backward[n].expr for n in training.derived[wq_x.name]} == {"phbj,ibj->phi", "phi,phbj->ibj"}


def test_training_contraction_flop_is_three_times_forward(bert_large):
    graph, training = bert_large
    forward = sum(primitive_flop(graph, p) for p in graph.primitives if p.kind == "einsum")
    total = sum(primitive_flop(training.graph, p) for p in training.graph.primitives if p.kind == "einsum")
    assert forward == 104 * 2**30  # Table III: 24 + 4 + 4 + 8 + 32 + 32 Gflop
    assert abs(total / forward - 3) < 0.01


def test_backward_operators_are_classified(bert):
    _, training = bert
    ops = training.operators()
    phases = [op.phase for op in ops]
    assert phases == sorted(phases, key=[FORWARD, BACKWARD].index)
    backward = [op for op in ops if op.phase == BACKWARD]
    assert {op.cls for op in backward} == {CONTRACTION, NORMALIZATION, ELEMENTWISE}
    assert sum(op.cls == CONTRACTION for op in backward) == 16  # dX and dW of the 8 contractions
    by_output = {t: op for op in backward for t in op.outputs}
    assert by_output["d_b1"].cls == NORMALIZATION  # bias gradient: a reduction
    assert by_output["d_pre_act"].cls == ELEMENTWISE  # ReLU backward: a mask
    # a forward operator now also outputs what the backward reads (saved activations)
    softmax = next(op for op in ops if op.phase == FORWARD and "probs" in op.outputs)
    assert softmax.cls == NORMALIZATION


def test_normalizations_are_recognised_structurally(bert):
    graph, training = bert
    cores = {(c.kind, c.input, c.reduced) for c in training.closed_forms}
    assert cores == {("softmax", "scores", "k"), ("layernorm", "resid1", "i"), ("layernorm", "resid2", "i")}
    # softmax backward: y * (dy - sum_k(dy * y)), no max, exp or division re-derived
    derived = [p for p in training.primitives(BACKWARD) if p.output.tensor.startswith("d_scores")]
    assert [p.kind for p in derived] == ["map", "reduce", "map"]
    assert derived[-1].expr == "in0 * (in1 - in2)" and derived[-1].inputs[0].tensor == "probs"


SPEC = textwrap.dedent('''
    import numpy as np
    from datamove.dataflow.spec import Tensor, dims

    B, N = dims(B=3, N=5)
    INDEX = {"b": B, "i": N, "j": N}


    def layer(x: Tensor("bi"), g: Tensor("i"), w: Tensor("ij")):
        mean = np.sum(x, axis=1) / np.float32(N)
        c = x - mean[:, None]
        var = np.sum(c * c, axis=1) / np.float32(N)
        r = np.float32(1) / np.sqrt(var + np.float32(1e-5))
        xn = c * r[:, None] * g[None, :]
        e = np.exp(xn)
        p = e / np.sum(e, axis=1)[:, None]
        q = p / np.sum(p * p, axis=1)[:, None]
        y = np.einsum("bi,ij->bj", q, w)
        return y
''')


def test_recognition_follows_the_math_not_the_spelling(tmp_path):
    """Layernorm through an inverse square root, softmax without the max, chained in one
    operator; a normalization that is neither (q) takes the generic chain rule; both ways agree."""
    path = tmp_path / "norms.py"
    path.write_text(SPEC)
    _, graph = forward_graph(path)
    closed, generic = build_training_graph(graph), build_training_graph(graph, closed_forms=False)
    assert sorted((c.kind, c.input) for c in closed.closed_forms) == [("layernorm", "x"), ("softmax", "xn")]
    assert len(closed.primitives(BACKWARD)) < len(generic.primitives(BACKWARD))
    rng = np.random.default_rng(1)
    values = {n: rng.standard_normal(tensor_shape(graph, n)) for n, t in graph.tensors.items() if t.role == "input"}
    values["d_y"] = rng.standard_normal(tensor_shape(graph, "y"))
    a, b = execute(closed.graph, values), execute(generic.graph, values)
    for name, grad in closed.input_grads.items():
        expected = b[generic.input_grads[name]]
        assert np.linalg.norm(a[grad] - expected) <= 1e-12 * np.linalg.norm(expected), name


def test_gradients_accumulate_and_identities_alias(bert):
    _, training = bert
    producer = training.graph.producer()
    # x feeds Q, K, V and the first residual: one n-ary sum of four contributions
    d_x = producer[training.grads["x"]]
    assert d_x.expr == "in0 + in1 + in2 + in3" and training.grads["x"] == "d_x"
    assert {op.tensor for op in d_x.inputs} == {"d_resid1", "d_x_via_wq_x", "d_x_via_wk_x", "d_x_via_wv_x"}
    # the residual's + passes the gradient through without a copy
    assert training.grads["attn_times_drop_attn_out"] == training.grads["resid1"] == "d_resid1"
    # bias gradients are sums over the broadcast letters
    d_bq = producer["d_bq"]
    assert (d_bq.kind, d_bq.expr, d_bq.inputs[0].letters, d_bq.output.letters) == ("reduce", "sum", "phbj", "ph")
    # every layer input gets a gradient with its own letters
    for name, grad in training.input_grads.items():
        assert training.graph.tensors[grad].letters == training.graph.tensors[name].letters
        assert training.graph.tensors[grad].role == "gradient" and grad in training.graph.outputs


@pytest.mark.parametrize("expr", [
    "in0 * in1", "in0 / sqrt(P)", "in0 / in1", "maximum(in0, 0)", "tanh(0.5 * in0 * in1) + exp(-in0)",
    "log(in0 * in0 + 1) - sqrt(in1 * in1 + 2)", "in0 ** 3 / (1 + abs(in1))", "minimum(in0, in1) * in0",
    "0.5 * in0 * (1 + tanh(0.7978845608028654 * (in0 + 0.044715 * in0 * in0 * in0)))",
])
def test_symbolic_derivatives_match_finite_differences(expr):
    rng = np.random.default_rng(2)
    point = {"in0": rng.uniform(0.2, 1.5, 11) * rng.choice([-1, 1], 11), "in1": rng.uniform(0.3, 2.0, 11),
             "P": 4.0}
    namespace = {"exp": np.exp, "log": np.log, "sqrt": np.sqrt, "tanh": np.tanh, "maximum": np.maximum,
                 "minimum": np.minimum, "abs": np.abs, "where": np.where, "sign": np.sign}
    tree = parse(expr)
    for var in ("in0", "in1"):
        grad = eval(tree.derivative(int(var[2:])).source(), namespace, dict(point))  # noqa: S307
        h = 1e-6
        up, down = dict(point), dict(point)
        up[var], down[var] = point[var] + h, point[var] - h
        numeric = (eval(expr, namespace, up) - eval(expr, namespace, down)) / (2 * h)  # noqa: S307
        np.testing.assert_allclose(np.broadcast_to(grad, numeric.shape), numeric, rtol=1e-6, atol=1e-8)


def test_relu_backward_is_a_mask(bert):
    graph, _ = bert
    training = build_training_graph(graph, relu_masks=False)  # the derivation, before relu_masks_from_outputs
    d_pre_act = training.graph.producer()["d_pre_act"]
    assert d_pre_act.expr == "in0 * (in1 > 0)" and d_pre_act.inputs[1].tensor == "pre_act"
    graph = training.graph
    values = {"d_act": np.ones(tensor_shape(graph, "d_act")),
              "pre_act": np.linspace(-1, 1, graph.size("ubj")).reshape(tensor_shape(graph, "pre_act"))}
    np.testing.assert_array_equal(run_primitive(graph, d_pre_act, values), values["pre_act"] > 0)


def test_relu_mask_comes_from_the_dropout_output(bert):
    """BERT's ``hidden = maximum(pre_act, 0) * drop_act``: the backward reads hidden (saved anyway
    for d_w2) and scales by the mask's keep factor, so neither pre_act nor the mask is needed."""
    _, training = bert
    d_pre_act = training.graph.producer()["d_pre_act"]
    assert d_pre_act.expr == "in0 * (in1 > 0) * scale_drop_act"
    assert [op.tensor for op in d_pre_act.inputs] == ["d_hidden", "hidden"]
    assert "d_act" not in training.graph.tensors and "act" not in training.grads
    assert training.derived["map:act"] == ("map:d_pre_act",) and training.derived["map:hidden"] == ()
    read = {op.tensor for p in training.primitives(BACKWARD) for op in p.inputs}
    assert not {"pre_act", "act", "drop_act"} & read and "hidden" in read
    ops = {op.name: op for op in fuse(training).operators}
    assert ops["hidden"].outputs == ("hidden",)  # pre_act: an intermediate of the forward operator
    assert set(ops["d_b1"].inputs) == {"d_hidden", "hidden"}  # d_b2 (reading d_ffn) beside its layernorm backward


@pytest.mark.parametrize("path,options", [("configs/bert.py", {"activation": "gelu"}), ("configs/gpt2.py", None)],
                         ids=["bert-gelu", "gpt2"])
def test_relu_masks_leave_gelu_alone(path, options):
    _, graph = forward_graph(path, None, options)
    assert build_training_graph(graph).graph == build_training_graph(graph, relu_masks=False).graph


def test_gelu_chain_differentiates_as_one_map():
    """GELU written out as nine maps: its backward is one map reading only GELU's input."""
    _, graph = forward_graph("configs/bert.py", BERT_DIMS, {"activation": "gelu"})
    training = build_training_graph(graph)
    producer = training.graph.producer()
    d_pre = producer[training.grads["pre_act"]]
    assert [op.tensor for op in d_pre.inputs] == [training.grads["act"], "pre_act"]
