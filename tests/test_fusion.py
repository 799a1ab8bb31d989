"""Fusion: the paper's fused operators found without their names, algebraic (stacked) fusion,
attention candidates, data movement, and the --analyze report."""
import json
import textwrap
import time
import warnings

import numpy as np
import pytest

from datamove.dataflow.analysis import analyse, data_movement
from datamove.dataflow.autodiff import BACKWARD, FORWARD, build_training_graph
from datamove.dataflow.executor import execute, tensor_shape
from datamove.dataflow.attention import attention_candidates
from datamove.dataflow.fusion import fuse
from datamove.dataflow.operators import CONTRACTION, operator_counts
from datamove.dataflow.pipeline import forward_graph

warnings.filterwarnings("ignore", module="dace")

BERT_DIMS = dict(B=2, L=5, N=12, H=3, P=4, U=7)
GPT2_DIMS = dict(B=2, T=5, D=12, H=3, E=4, F=7)

# Ivanov et al., Sec. IV-A / Table III: each fused element-wise or normalization operator, by
# the unfused operators it merges (named after the tensor each computes).
PAPER = {
    # forward
    "AIB (attention input bias, Q/K/V stacked)": {"q", "k", "v"},
    "SM (scaling, softmax, dropout)": {"scores", "probs", "alpha"},
    "DRLN (output bias, dropout, residual, layernorm)": {"attn", "attn_times_drop_attn_out", "resid1", "x1"},
    "BRD (bias, ReLU, dropout)": {"pre_act", "act", "hidden"},
    "BDRLN (bias, dropout, residual, layernorm)": {"ffn", "ffn_times_drop_ffn_out", "resid2", "y"},
    # backward
    "BSB (layernorm dgamma, dbeta)": {"d_ln2_beta", "d_ln2_gamma_unreduced", "d_ln2_gamma"},
    "BLNRD (layernorm dX, dropout dX; FFN)": {"d_diff_div_expr", "d_resid2_g_xhat", "d_resid2", "d_ffn"},
    # dropout dX and ReLU dX are one map reading hidden (dataflow.autodiff.relu_masks_from_outputs)
    "BDRB (bias dW, dropout dX, ReLU dX, bias dW)": {"d_b2", "d_pre_act", "d_b1"},
    "EBSB (residual, layernorm dgamma, dbeta)": {"d_x1", "d_ln1_beta", "d_ln1_gamma_unreduced", "d_ln1_gamma"},
    "BLNRD (layernorm dX, dropout dX; attention)": {"d_layernorm_diff_div_expr", "d_resid1_g_xhat", "d_resid1",
                                                    "d_attn"},
    "BAOB (attention output bias dW)": {"d_bo"},
    "BS (dropout dX, softmax dX, scaling)": {"d_probs", "d_scores_dy_y", "d_scores", "d_k_q"},
    "BAIB (attention input bias dW, Q/K/V stacked)": {"d_bq", "d_bk", "d_bv"},
    "BEI (encoder input residual)": {"d_x"},
}
# Where datamove departs from the table: the FFN output bias gradient (d_b2, the column sum of
# d_ffn) stays an operator of its own rather than joining d_b1 across the FFN's second GEMM; the
# candidates join it with the layernorm backward that writes d_ffn (layouts.space.column_sum_joins),
# so d_ffn is not read again (BERT-large B=8 L=512 on an H100: 10 us less).
FUSED = {**{name: members for name, members in PAPER.items() if not name.startswith("BDRB")},
         "BRB (dropout dX, ReLU dX, bias dW)": {"d_pre_act", "d_b1"},
         "BB (FFN output bias dW)": {"d_b2"}}


def _fused(path, dims=None, options=None):
    _, graph = forward_graph(path, dims, options)
    training = build_training_graph(graph)
    return graph, training, fuse(training)


@pytest.fixture(scope="module")
def bert():
    return _fused("configs/bert.py", BERT_DIMS)


@pytest.fixture(scope="module")
def bert_large():
    return _fused("configs/bert.py")


@pytest.mark.parametrize("which", ["bert", "bert_large"])
def test_bert_fused_operators_are_the_papers(which, request):
    _, _, fused = request.getfixturevalue(which)
    found = {frozenset(fused.merged[op.name]): op for op in fused.operators if op.cls != CONTRACTION}
    assert set(found) == {frozenset(members) for members in FUSED.values()}  # one-to-one
    phases = {name: found[frozenset(members)].phase for name, members in FUSED.items()}
    assert list(phases.values()) == [FORWARD] * 5 + [BACKWARD] * 10
    joined = {name for op in fused.operators for name in fused.rules[op.name]}
    assert "join-reduction-across-contraction" not in joined  # BERT's one candidate is d_b2's (FUSED)


def test_bert_algebraic_fusion_stacks_qkv(bert):
    graph, _, fused = bert
    stacks = {name: stack for name, stack in fused.stacks.items() if fused.operators[
        [op.name for op in fused.operators].index(name)].cls == CONTRACTION}
    by_members = {frozenset(fused.merged[name]): stack for name, stack in stacks.items()}
    assert set(by_members) == {frozenset({"wq_x", "wk_x", "wv_x"}), frozenset({"d_wq", "d_wk", "d_wv"}),
                               frozenset({"d_x_via_wq_x", "d_x_via_wk_x", "d_x_via_wv_x"})}
    letter = by_members[frozenset({"wq_x", "wk_x", "wv_x"})].letter
    assert letter not in graph.letter_dims
    assert by_members[frozenset({"wq_x", "wk_x", "wv_x"})].expr == f"{letter}phi,ibj->{letter}phbj"
    assert by_members[frozenset({"d_wq", "d_wk", "d_wv"})].expr == f"{letter}whbk,ibk->{letter}whi"  # x shared
    assert by_members[frozenset({"d_x_via_wq_x", "d_x_via_wk_x", "d_x_via_wv_x"})].expr == \
        f"{letter}whi,{letter}whbk->ibk"  # summed over the stack letter
    # the dX stack owns the sum of its three outputs; the residual (BEI) adds the rest
    dx = next(op for op in fused.operators if set(fused.merged[op.name]) == {"d_x_via_wq_x", "d_x_via_wk_x",
                                                                                "d_x_via_wv_x"})
    assert dx.outputs == ("d_x_stacked",)
    bei = next(op for op in fused.operators if fused.merged[op.name] == ("d_x",))
    assert set(bei.inputs) == {"d_resid1", "d_x_stacked"}


def test_bert_data_movement(bert_large):
    _, training, fused = bert_large
    unfused, after = analyse(training.graph, fused.unfused), analyse(fused.graph, fused.operators)
    before, moved = data_movement(unfused), data_movement(after)
    assert moved["non_contraction"] <= 0.8 * before["non_contraction"]
    assert moved["total"] < before["total"]
    # fusion moves data, not flop
    assert sum(r.flop for r in after) == sum(r.flop for r in unfused)
    # Table III: the stacked Q, K, V projection reads 7.3e6 and writes 12.5e6 elements
    qkv = next(r for r in after if set(fused.merged[r.operator.name]) == {"wq_x", "wk_x", "wv_x"})
    assert (round(qkv.input_elements / 1e6, 1), round(qkv.output_elements / 1e6, 1)) == (7.3, 12.6)


def test_fused_operators_respect_the_rules(bert):
    _, _, fused = bert
    graph = fused.graph
    for op in fused.operators:
        assert {fused.phases[p.name] for p in op.primitives} == {op.phase}
        reductions = {frozenset(p.reduced) for p in op.primitives if p.kind == "reduce"}
        if op.cls != CONTRACTION and op.name not in fused.stacks:
            assert len(reductions) <= 1, op.name  # fuse until a reduction changes
            if "join-reduction-across-contraction" not in fused.rules[op.name]:
                spaces = {frozenset(p.letters) for p in op.primitives}
                assert len(frozenset().union(*spaces)) == max(map(len, spaces)), op.name  # one iteration space
        if op.cls == CONTRACTION:
            assert all(p.kind == "einsum" or p.expr.startswith("in0 +") for p in op.primitives)
    counts = [operator_counts(graph, op) for op in fused.operators]
    assert all(c["input_elements"] > 0 for c in counts)


def test_bert_attention_candidate(bert):
    _, _, fused = bert
    (candidate,) = attention_candidates(fused)
    sm = next(op.name for op in fused.operators if set(fused.merged[op.name]) == PAPER["SM (scaling, softmax, dropout)"])
    assert candidate.members == ("k_q", sm, "gamma")
    assert candidate.outputs == ("gamma",) and set(candidate.saved) == {"probs", "alpha"}
    assert set(candidate.inputs) == {"k", "q", "drop_attn", "v"}
    assert {"einsum:k_q", "map:scores", "map:probs", "map:alpha", "einsum:gamma"} <= set(candidate.primitives)
    # the candidate sits beside the plan: the fused operators are unchanged
    assert {"k_q", "gamma", sm} <= {op.name for op in fused.operators}


def test_gpt2_fused_graph():
    _, _, fused = _fused("configs/gpt2.py", GPT2_DIMS)
    contractions = [fused.merged[name] for name in fused.stacks if name.startswith("stack(")]
    assert {frozenset(m) for m in contractions} >= {frozenset({"h1_wq", "h1_wk", "h1_wv"}),
                                                    frozenset({"d_wq", "d_wk", "d_wv"})}
    softmax = next(op for op in fused.operators if "weights_div_total_slice" in {p.output.tensor for p in op.primitives})
    assert {"map:expr_div_expr", "map:logits", "map:attention"} <= {p.name for p in softmax.primitives}
    (candidate,) = attention_candidates(fused)
    assert candidate.members[0] == "q_k" and candidate.members[2] == "context" and "causal" in candidate.inputs
    before = data_movement(analyse(fused.training.graph, fused.unfused))
    after = data_movement(analyse(fused.graph, fused.operators))
    assert after["non_contraction"] <= 0.8 * before["non_contraction"]


SCALED = textwrap.dedent('''
    import numpy as np
    from datamove.dataflow.spec import Tensor, dims

    B, N = dims(B=3, N=5)
    INDEX = {"b": B, "i": N, "j": N, "k": N}


    def layer(x: Tensor("bi"), w: Tensor("ij"), v: Tensor("jk")):
        h = np.einsum("bi,ij->bj", x, w) * np.float32(0.5)
        y = np.einsum("bj,jk->bk", h, v)
        return y
''')


def test_lone_scaling_fuses_into_a_contraction(tmp_path):
    path = tmp_path / "scaled.py"
    path.write_text(SCALED)
    graph, training, fused = _fused(path)
    assert all(op.cls == CONTRACTION for op in fused.operators)
    scalings = [op for op in fused.operators if any(p.kind == "map" for p in op.primitives)]
    assert len(scalings) == 2 and all("scale-into-contraction" in fused.rules[op.name] for op in scalings)
    rng = np.random.default_rng(4)
    values = {n: rng.standard_normal(tensor_shape(graph, n)) for n, t in graph.tensors.items() if t.role == "input"}
    values["d_y"] = rng.standard_normal(tensor_shape(graph, "y"))
    a = execute(training.graph, values)
    b = execute(fused.graph, values, schedule=fused.operators)
    for grad in training.input_grads.values():
        np.testing.assert_allclose(b[grad], a[grad], rtol=1e-13)


def test_analyze_cli_reports_training_and_fusion(tmp_path, capsys):
    from datamove.cli import main

    out = tmp_path / "bert.json"
    started = time.perf_counter()
    assert main(["configs/bert.py", "--analyze", "--json", str(out)]) == 0
    assert time.perf_counter() - started < 60
    data = json.loads(out.read_text())
    assert {op["phase"] for op in data["operators"]} == {FORWARD, BACKWARD}
    assert {"forward/contraction", "backward/contraction"} <= set(data["totals"])
    for entry in data["fused"]:
        assert {"name", "members", "class", "phase", "input_elements", "output_elements"} <= set(entry)
    assert len([e for e in data["fused"] if e["class"] != CONTRACTION]) == len(FUSED)
    movement = data["data_movement"]
    assert movement["fused"]["non_contraction"] <= 0.8 * movement["unfused"]["non_contraction"]
    assert movement["reduction_percent"]["total"] > 20
    assert data["attention_candidates"][0]["outputs"] == ["gamma"]
    printed = capsys.readouterr().out
    assert "backward" in printed and "fused operator" in printed and "non_contraction" in printed


TWO_LINEAR = textwrap.dedent('''
    import numpy as np
    from datamove.dataflow.spec import Tensor, dims

    B, N, U = dims(B=3, N=5, U=7)
    INDEX = {"b": B, "i": N, "u": U, "k": N}


    def layer(x: Tensor("bi"), w1: Tensor("iu"), b1: Tensor("u"), w2: Tensor("uk"), b2: Tensor("k"),
              w3: Tensor("ki"), b3: Tensor("i")):
        h = np.maximum(np.einsum("bi,iu->bu", x, w1) + b1, 0)
        y = np.einsum("bu,uk->bk", h, w2) + b2
        z = np.einsum("bk,ki->bi", y, w3) + b3
        return z
''')


def test_a_bias_gradient_of_a_contractions_output_joins_across_a_contraction(tmp_path):
    """y's bias gradient sums d_y, which a contraction writes (z's dX): it joins b1's, past the
    contraction that reads d_y (``JoinReductionAcrossContraction``); no normalization writes d_y
    to hold that sum instead (BERT's d_b2, ``FUSED``)."""
    path = tmp_path / "two_linear.py"
    path.write_text(TWO_LINEAR)
    _, _, fused = _fused(path)
    joined = [op for op in fused.operators if "join-reduction-across-contraction" in fused.rules[op.name]]
    assert len(joined) == 1 and {"d_b2", "d_b1"} <= set(fused.merged[joined[0].name])
