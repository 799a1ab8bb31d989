"""Front end: spec -> SDFG -> primitive graph -> classified operators, with exact counts.

Table III of Ivanov et al. is the reference for the BERT-large forward contractions (Gflop = 2^30
flop, elements in 1e6); the paper stacks Q, K, V into one row, so that row is compared with the
union of our three projections (x counted once).
"""
import json
import math

import pytest

from datamove.dataflow.operators import CONTRACTION, ELEMENTWISE, NORMALIZATION, group_operators, operator_counts
from datamove.dataflow.pipeline import analyse_spec, forward_graph

BERT, GPT2 = "configs/bert.py", "configs/gpt2.py"


@pytest.fixture(scope="module")
def bert():
    return analyse_spec(BERT)


def _by_einsum(analysis):
    return {op.primitives[0].expr: op for op in analysis.operators if op.cls == CONTRACTION}


def _truncated(value: float) -> float:
    """The paper prints element counts truncated to one decimal (4,194,304 elements as 4.1)."""
    return math.floor(value * 10) / 10


def _group_counts(analysis, ops):
    graph = analysis.graph
    inputs = {t for op in ops for t in op.inputs}
    outputs = {t for op in ops for t in op.outputs}
    return (sum(operator_counts(graph, op)["flop"] for op in ops) / 2**30,
            sum(graph.size(graph.tensors[t].letters) for t in inputs) / 1e6,
            sum(graph.size(graph.tensors[t].letters) for t in outputs) / 1e6)


TABLE_III = {  # paper row: (einsums of our spec, Gflop, input 1e6, output 1e6)
    "Q, K, V": (("phi,ibj->phbj", "phi,ibk->phbk", "whi,ibk->whbk"), 24, 7.3, 12.5),
    "QK^T": (("phbk,phbj->hbjk",), 4, 8.3, 33.5),
    "Gamma": (("whbk,hbjk->whbj",), 4, 37.7, 4.1),
    "Out": (("whi,whbj->ibj",), 8, 5.2, 4.1),
    "Linear 1": (("ui,ibj->ubj",), 32, 8.3, 16.7),
    "Linear 2": (("iu,ubj->ibj",), 32, 20.9, 4.1),
}


@pytest.mark.parametrize("row", TABLE_III)
def test_bert_contractions_match_table_iii(bert, row):
    einsums, gflop, inputs, outputs = TABLE_III[row]
    ops = [_by_einsum(bert)[e] for e in einsums]
    got = _group_counts(bert, ops)
    assert got[0] == pytest.approx(gflop, rel=0.02), (row, got)
    for value, expected in zip(got[1:], (inputs, outputs)):
        assert _truncated(value) == pytest.approx(expected, rel=0.02), (row, got)


def test_bert_classification(bert):
    classes = [op.cls for op in bert.operators]
    assert classes.count(CONTRACTION) == 8
    norms = [op for op in bert.operators if op.cls == NORMALIZATION]
    assert len(norms) == 3
    softmax, ln1, ln2 = norms
    assert sorted(p.expr for p in softmax.primitives if p.kind == "reduce") == ["max", "sum"]
    assert softmax.reduced == "k" and softmax.inputs == ("scores",)
    for ln, params in ((ln1, {"ln1_gamma", "ln1_beta"}), (ln2, {"ln2_gamma", "ln2_beta"})):
        assert [p.expr for p in ln.primitives if p.kind == "reduce"] == ["sum", "sum"]
        assert ln.reduced == "i" and params <= set(ln.inputs)
        assert operator_counts(bert.graph, ln)["flop"] / 2**30 == pytest.approx(0.027, rel=0.05)  # Table III
    elementwise = [op for op in bert.operators if op.cls == ELEMENTWISE]
    assert all(len(op.primitives) == 1 for op in elementwise)  # bias, dropout, ReLU, residual, scale: one map each
    read = {frozenset(op.inputs) for op in elementwise}
    for tensors in ({"wq_x", "bq"}, {"w1_x1", "b1"}, {"probs", "drop_attn"}, {"act", "drop_act"}, {"pre_act"}):
        assert frozenset(tensors) in read
    relu = next(op for op in elementwise if op.inputs == ("pre_act",))
    assert relu.primitives[0].expr == "maximum(in0, 0)"


def test_gelu_option_makes_one_elementwise_operator():
    analysis = analyse_spec(BERT, options={"activation": "gelu"})
    (act,) = [op for op in analysis.operators if op.inputs == ("pre_act",)]
    assert act.cls == ELEMENTWISE and len(act.primitives) > 5 and any("tanh" in p.expr for p in act.primitives)


def test_gpt2_classification():
    analysis = analyse_spec(GPT2)
    by_class = {c: [op for op in analysis.operators if op.cls == c] for c in (CONTRACTION, NORMALIZATION, ELEMENTWISE)}
    assert len(by_class[CONTRACTION]) == 8
    ln1, softmax, ln2 = by_class[NORMALIZATION]
    assert ln1.inputs[0] == "x" and ln1.reduced == "d" and ln2.reduced == "d" and softmax.reduced == "t"
    gelu = next(op for op in by_class[ELEMENTWISE] if op.outputs == ("gelu",))
    assert gelu.inputs == ("up",)
    causal = next(op for op in by_class[ELEMENTWISE] if "causal" in op.inputs)
    assert len(causal.primitives) == 1
    # GPT-2 layout is batch-major: the model input keeps its own letters
    assert analysis.graph.tensors["x"].letters == "bsd"


def _flop_by_einsum(analysis):
    return {e: operator_counts(analysis.graph, op)["flop"] for e, op in _by_einsum(analysis).items()}


@pytest.mark.parametrize("dims", [dict(B=3, L=7, N=10, H=2, P=5, U=11), dict(B=1, L=33, N=6, H=3, P=2, U=9)])
def test_counts_follow_symbolic_dims(dims):
    analysis = analyse_spec(BERT, dims)
    flop = _flop_by_einsum(analysis)
    B, L, N, H, P, U = (dims[d] for d in "BLNHP U".replace(" ", ""))
    assert flop["phi,ibj->phbj"] == 2 * P * H * N * B * L
    assert flop["phbk,phbj->hbjk"] == 2 * P * H * B * L * L
    assert flop["ui,ibj->ubj"] == 2 * U * N * B * L
    # the same primitive graph re-evaluated at other dims (no re-parse) agrees
    _, default_graph = forward_graph(BERT)
    resized = default_graph.with_dims(analysis.graph.dim_values)
    assert [operator_counts(resized, op) for op in group_operators(resized)] == \
        [operator_counts(analysis.graph, op) for op in analysis.operators]


def test_cli_json(tmp_path, capsys):
    from datamove.cli import main

    out = tmp_path / "analysis.json"
    assert main([BERT, "--analyze", "--dims", "B=2,L=16", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["dims"]["B"] == 2 and data["dims"]["L"] == 16
    for op in data["operators"]:
        assert {"name", "class", "phase", "flop", "input_elements", "output_elements", "inputs", "outputs"} <= set(op)
        assert op["class"] in (CONTRACTION, NORMALIZATION, ELEMENTWISE)
    assert "contraction" in capsys.readouterr().out
