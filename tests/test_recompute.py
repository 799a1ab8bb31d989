"""Rematerialization (``dataflow.recompute``): Llama's SwiGLU MLP no longer stores silu(gate) for its
backward, which recomputes it from gate (and its RMSNorms no longer store x / rms, recomputed from x
and rms); the fused graph keeps its operators, less those stored tensors; the training graph still
runs on the float64 executor, operator by operator, to the very gradients.  Where a rule of the
pass fails (the tensor read by an einsum in the forward, a reduction on its chain) nothing changes."""
import warnings

import numpy as np
import pytest

from datamove.dataflow.analysis import analyse, data_movement
from datamove.dataflow.autodiff import build_training_graph
from datamove.dataflow.executor import execute
from datamove.dataflow.fusion import fuse
from datamove.dataflow.pipeline import analyse_spec, forward_graph
from datamove.dataflow.recompute import SUFFIX, recompute_elementwise
from test_executor import SEED, random_inputs

warnings.filterwarnings("ignore", module="dace")

DIMS = dict(B=2, T=21, D=48, H=6, KV=2, E=16, F=40)
SILU = "gate_times_expr"  # silu(gate) = gate * sigmoid(gate), as configs/llama.py's front end names it
NORMALIZED = {"rms_norm_x_div_expr", "x_div_expr"}  # x / rms of the attention's and the MLP's RMSNorm


@pytest.fixture(scope="module")
def llama():
    """(the pipeline's analysis, the fused graph of the derivation alone) at ``DIMS``."""
    analysis = analyse_spec("configs/llama.py", DIMS)
    return analysis, fuse(build_training_graph(analysis.graph))


def test_swiglu_recomputes_silu_of_gate(llama):
    analysis, plain = llama
    before = {op.name: op for op in plain.operators}
    after = {op.name: op for op in analysis.fused.operators}
    assert SILU in before["gate_expr_times_expr"].outputs and {SILU, "gate"} <= set(before["d_gate"].inputs)
    assert after["gate_expr_times_expr"].outputs == ("gate_expr_times_expr",)
    assert "gate" in after["d_gate"].inputs and SILU not in after["d_gate"].inputs
    recomputed = {p.output.tensor for p in after["d_gate"].primitives if p.output.tensor.endswith(SUFFIX)}
    assert SILU + SUFFIX in recomputed and not any(t.endswith(SUFFIX) for op in after.values() for t in op.outputs)


def test_nothing_else_changes_in_kind(llama):
    """The same operators (names, classes, phases, in the same order); each differs at most by a
    stored tensor no longer written or read, and the backward reading what it is recomputed from
    (tensors the forward stores anyway, or the layer's inputs); less data moved in all."""
    analysis, plain = llama
    before, after = plain.operators, analysis.fused.operators
    assert [(op.name, op.cls, op.phase) for op in before] == [(op.name, op.cls, op.phase) for op in after]
    gone = {SILU} | NORMALIZED
    stored = {t for op in before if op.phase == "forward" for t in op.outputs}
    layer_inputs = {t for t, info in plain.graph.tensors.items() if info.role in ("input", "constant")}
    for old, new in zip(before, after):
        assert set(new.outputs) == set(old.outputs) - gone, old.name
        assert set(old.inputs) - set(new.inputs) <= gone, old.name
        assert set(new.inputs) - set(old.inputs) <= (stored | layer_inputs) - gone, old.name
    assert stored - {t for op in after if op.phase == "forward" for t in op.outputs} == gone
    moved = data_movement(analysis.fused_rows)
    assert moved["total"] < data_movement(analyse(plain.graph, plain.operators))["total"]


def test_recomputed_graph_runs_to_the_same_values(llama):
    """The float64 executor, on the fused schedule, gives the derivation's forward output and gradients."""
    analysis, plain = llama
    training = analysis.training
    values = random_inputs(training.graph, training, np.random.default_rng(5))
    ours = execute(analysis.fused.graph, values, SEED, schedule=analysis.fused.operators)
    theirs = execute(plain.graph, values, SEED, schedule=plain.operators)
    for name in training.graph.outputs:
        np.testing.assert_allclose(ours[name], theirs[name], rtol=1e-12, atol=1e-14, err_msg=name)


EINSUM_READER = '''
import numpy as np
from datamove.dataflow.spec import Tensor, dims
B, T, D, F = dims(B=3, T=5, D=7, F=11)
INDEX = {"b": B, "t": T, "d": D, "f": F}

def f(x: Tensor("btd"), w1: Tensor("df"), wu: Tensor("df"), wd: Tensor("fd"),
      wc: Tensor("fd", requires_grad=False)):
    a = x @ w1
    s = a / (1.0 + np.exp(-a))
    return (s * (x @ wu)) @ wd%s
'''

REDUCTION_ON_CHAIN = '''
import numpy as np
from datamove.dataflow.spec import Tensor, dims
B, T, D = dims(B=3, T=5, D=7)
INDEX = {"b": B, "t": T, "d": D}

def f(p: Tensor("btd"), q: Tensor("bt"), v: Tensor("bt")):
    x = q + %s
    return x * v + q * q + np.sum(p * p, axis=-1)
'''


@pytest.mark.parametrize("spec, tensor, recomputed", [
    (EINSUM_READER % "", "s", True),  # silu(a) read by a map only: recomputed from a
    (EINSUM_READER % " + s @ wc", "s", False),  # and by an einsum (whose backward does not read it): stored
    (REDUCTION_ON_CHAIN % "np.exp(q)", "x", True),  # x from q (read back anyway) by maps: recomputed
    (REDUCTION_ON_CHAIN % "np.sum(p, axis=-1)", "x", False),  # x through a reduction: stored
], ids=["map-reader", "einsum-reader", "map-chain", "reduction-on-chain"])
def test_recomputes_only_within_the_rule(tmp_path, spec, tensor, recomputed):
    path = tmp_path / "spec.py"
    path.write_text(spec)
    _, graph = forward_graph(path)
    training = build_training_graph(graph)
    result = recompute_elementwise(training)
    read_back = lambda t: {op.tensor for p in t.primitives("backward") for op in p.inputs}  # noqa: E731
    assert tensor in read_back(training) and (tensor not in read_back(result)) == recomputed
    stored = lambda fused: {t for op in fused.operators if op.phase == "forward" for t in op.outputs}  # noqa: E731
    assert (tensor in stored(fuse(result))) != recomputed and tensor in stored(fuse(training))
