"""Shuffles (``dataflow.shuffle``): rotate_half's einsum with a constant signed permutation run as an
element-wise operation.  Recognised from the constant's value (forward and the autodiff's transposed
einsum), classified element-wise, fused with RoPE's maps into one operator per pass (forward
``q = q_x * cos + rotate_half(q_x) * sin``, backward ``d_q_x = d_q * cos + rotate_half^T(d_q * sin)``), and
generated as a load at the moved index (the backward's ``d_q * sin`` recomputed there), against
NumPy at odd sizes through the Triton interpreter; the sweep harness checks such an operator
against its float64 evaluation.  The Llama layer's export runs it: ``tests/test_llama_gqa.py``."""
import functools

import numpy as np
import pytest
import torch

from datamove.dataflow.executor import known_value
from datamove.dataflow.graph import Operand, Primitive, PrimitiveGraph, TensorInfo
from datamove.dataflow.operators import ELEMENTWISE, make_operator, operator_counts
from datamove.dataflow.shuffle import Piece, permutation_pieces, shuffle_of
from datamove.harness import sweep_variants as sv
from datamove.kernels.codegen import allocate, compile_operator, generate_source
from datamove.layouts.space import Configuration, configurations, default_configuration

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="float32 through the Triton interpreter (CPU)")

LLAMA_DIMS = dict(B=2, T=21, D=48, H=6, KV=2, E=16, F=40)
ROTATE_HALF = ("where((0 <= i1) & (i1 < (E - (E // 2))) & (i0 == i1 + (E // 2)), -1.0, 0.0) + "
               "where(((E - (E // 2)) <= i1) & (i1 < E) & (i0 == i1 + ((E // 2) - E)), 1.0, 0.0)")
# three pieces of other lengths and factors: [x[7:], 2 * x[:3], -0.5 * x[3:7]] of an axis of 10
THREE = ("where((0 <= i1) & (i1 < E - 7) & (i0 == i1 + 7), 1.0, 0.0) + "
         "where((E - 7 <= i1) & (i1 < E - 4) & (i0 == i1 + (7 - E)), 2.0, 0.0) + "
         "where((E - 4 <= i1) & (i1 < E) & (i0 == i1 + (7 - E)), -0.5, 0.0)")


@functools.lru_cache(maxsize=1)
def llama():
    from datamove.dataflow.pipeline import analyse_spec
    return analyse_spec("configs/llama.py", LLAMA_DIMS)


def matrix(pieces, extent: int) -> np.ndarray:
    """The (read, written) matrix of ``pieces`` at E = ``extent``."""
    result = np.zeros((extent, extent))
    for piece in pieces:
        start, end, shift = piece.values({"E": extent})
        for e in range(start, end):
            result[e + shift, e] = piece.factor
    return result


def test_pieces_are_read_from_the_constants_value():
    pieces = permutation_pieces(ROTATE_HALF)
    assert [p.factor for p in pieces] == [-1.0, 1.0]
    assert [p.values({"E": 10}) for p in pieces] == [(0, 5, 5), (5, 10, -5)]
    assert permutation_pieces("where(i1 // (H // KV) == i0, 1.0, 0.0)") is None  # np.repeat's
    assert permutation_pieces("where(i1 >= i0 + 1, -inf, 0.0)") is None  # a causal mask
    assert Piece("0", "E // 2", "E - E // 2", 1.0).transposed().values({"E": 9}) == (5, 9, -5)


def test_llamas_rotations_are_shuffles_and_nothing_else():
    training = llama().training.graph
    found = {p.name: s for p in training.primitives if (s := shuffle_of(training, p)) is not None}
    assert set(found) == {"einsum:q_x_concat_e", "einsum:k_x_concat_e", "einsum:d_q_x_via_q_x_concat_e",
                          "einsum:d_k_x_via_k_x_concat_e"}
    value = known_value(training, "concat_e")  # (read a, written e)
    for name, shuffle in found.items():
        assert shuffle.constant == "concat_e" and shuffle.source == 0
        forward = not name.startswith("einsum:d_")
        assert np.array_equal(matrix(shuffle.pieces, 16), value if forward else value.T), name


def test_the_fused_graph_runs_rope_element_wise():
    """No concat_e GEMM; q, k (forward) and d_q_x, d_k_x (backward) each one element-wise operator
    reading the projection (its gradient) directly, never the constant."""
    fused = llama().fused
    ops = {op.name: op for op in fused.operators}
    for op in fused.operators:
        assert not (op.cls == "contraction" and any(o.tensor == "concat_e" for p in op.primitives for o in p.inputs))
        assert "concat_e" not in op.inputs
    expected = {"q": ("q_x", "forward"), "k": ("k_x", "forward"), "d_q_x": ("d_q", "backward"),
                "d_k_x": ("d_k", "backward")}
    for name, (source, phase) in expected.items():
        op = ops[name]
        assert op.cls == ELEMENTWISE and op.phase == phase and op.reduced == ""
        assert set(op.inputs) == {source, "cos", "sin"} and op.outputs == (name,)
        assert sum(shuffle_of(fused.graph, p) is not None for p in op.primitives) == 1
        counts = operator_counts(fused.graph, op)  # the shuffled array read once, as a plain read
        size = fused.graph.size(fused.graph.tensors[source].letters)
        assert counts["input_elements"] == size + 2 * fused.graph.size("se")
    source = generate_source(fused.graph, ops["q"], default_configuration(fused.graph, ops["q"]))
    assert "tl.where(idx_e < size_e - size_e // 2, idx_e + (size_e // 2), idx_e + (size_e // 2 - size_e))" in source


# --- the generated kernel against NumPy ---------------------------------------------------------

DIMS = {"R": 3, "C": 5, "E": 10}


def shuffle_graph(value: str, backward: bool) -> tuple[PrimitiveGraph, object]:
    """x[r, c, e], s[c, e], constant m[a, e] of ``value``.  Forward: y = x * s + shuffle(x);
    backward (the transposed einsum of a value computed inside): y = shuffle^T(x * s) + x."""
    tensors = {"x": TensorInfo("x", "rce", "input"), "s": TensorInfo("s", "ce", "input"),
               "m": TensorInfo("m", "ae", "constant", value=value), "t": TensorInfo("t", "rce", "intermediate"),
               "u": TensorInfo("u", "rce", "intermediate"), "y": TensorInfo("y", "rce", "output")}
    if backward:
        prims = [Primitive("map:t", "map", (Operand("x", "rce"), Operand("s", "ce")), Operand("t", "rce"), "in0 * in1"),
                 Primitive("einsum:u", "einsum", (Operand("t", "rce"), Operand("m", "ae")), Operand("u", "rca"),
                           "rce,ae->rca"),
                 Primitive("map:y", "map", (Operand("u", "rce"), Operand("x", "rce")), Operand("y", "rce"), "in0 + in1")]
    else:
        prims = [Primitive("map:t", "map", (Operand("x", "rce"), Operand("s", "ce")), Operand("t", "rce"), "in0 * in1"),
                 Primitive("einsum:u", "einsum", (Operand("x", "rca"), Operand("m", "ae")), Operand("u", "rce"),
                           "rca,ae->rce"),
                 Primitive("map:y", "map", (Operand("t", "rce"), Operand("u", "rce")), Operand("y", "rce"), "in0 + in1")]
    graph = PrimitiveGraph(tensors, prims, {"r": "R", "c": "C", "e": "E", "a": "E"}, dict(DIMS), ["y"])
    return graph, make_operator(graph, prims, "forward")


@pytest.mark.parametrize("value", [ROTATE_HALF, THREE], ids=["rotate_half", "three_pieces"])
@pytest.mark.parametrize("backward", [False, True], ids=["forward", "transposed"])
def test_generated_shuffle_matches_numpy(value, backward):
    graph, op = shuffle_graph(value, backward)
    assert op.cls == ELEMENTWISE and op.inputs == ("x", "s") and op.outputs == ("y",)
    rng = np.random.default_rng(4)
    x, s = rng.standard_normal((3, 5, 10)), rng.standard_normal((5, 10))
    m = known_value(graph, "m")
    want = (np.einsum("rce,ae->rca", x * s, m) + x) if backward else (x * s + np.einsum("rca,ae->rce", x, m))
    configs = configurations(graph, op)
    chosen = [default_configuration(graph, op)] + [c for c in configs if c.knobs["vector"] != "e"][:1] \
        + [c for c in configs if c.layouts["x"] != "rce"][:1]
    assert len(chosen) == 3
    for config in chosen:
        out = _run(graph, op, config, {"x": x, "s": s})
        np.testing.assert_allclose(out["y"].double().numpy(), want, rtol=1e-5, atol=1e-5, err_msg=config.key())


def _run(graph, op, config, arrays: dict) -> dict:
    """The generated kernel of ``op`` in ``config`` on ``arrays`` (float32, each stored in its layout)."""
    inputs = {}
    for name, value in arrays.items():
        inputs[name] = allocate(graph, name, config.layouts[name], torch.float32)
        inputs[name].copy_(torch.from_numpy(value))
    return compile_operator(graph, op, config).run(inputs, {})


@pytest.mark.parametrize("mode", ["row", "loop"])
def test_generated_shuffle_inside_a_normalization(mode):
    """y = x * s + shuffle(x) summed over the moved axis e, z = y * sum_e(y): whole rows, or a loop
    over chunks of e (the moved index then reaches outside the chunk)."""
    graph, op = shuffle_graph(THREE, backward=False)
    tensors = dict(graph.tensors, y=TensorInfo("y", "rce", "intermediate"), r=TensorInfo("r", "rc", "intermediate"),
                   z=TensorInfo("z", "rce", "output"))
    prims = op.primitives + (Primitive("reduce:r", "reduce", (Operand("y", "rce"),), Operand("r", "rc"), "sum"),
                             Primitive("map:z", "map", (Operand("y", "rce"), Operand("r", "rc")), Operand("z", "rce"),
                                       "in0 * in1"))
    graph = PrimitiveGraph(tensors, list(prims), graph.letter_dims, dict(DIMS), ["z"])
    op = make_operator(graph, list(prims), "forward")
    assert op.cls == "normalization" and op.inputs == ("x", "s") and op.outputs == ("z",)
    rng = np.random.default_rng(5)
    x, s = rng.standard_normal((3, 5, 10)), rng.standard_normal((5, 10))
    y = x * s + np.einsum("rca,ae->rce", x, known_value(graph, "m"))
    want = y * y.sum(axis=2, keepdims=True)
    row = next(c for c in configurations(graph, op) if c.knobs["mode"] == "row" and c.knobs["vector"] == "e")
    config = row if mode == "row" else Configuration(row.layouts, {**row.knobs, "mode": "loop", "block_col": 4})
    out = _run(graph, op, config, {"x": x, "s": s})
    np.testing.assert_allclose(out["z"].double().numpy(), want, rtol=1e-5, atol=1e-4, err_msg=config.key())


def test_the_sweep_checks_a_shuffle_against_float64():
    """The sweep's workspace evaluates the constant at its value and a shuffle unscaled: RoPE's
    generated operators and their eager baselines pass their check."""
    from datamove.job import fused_training

    fused = fused_training(llama())  # as the sweep reads it (the snapshot's form)
    ws = sv.Workspace(fused, "cpu", torch.float32)
    for name in ("q", "d_q_x"):
        op = next(o for o in fused.operators if o.name == name)
        for variant in (sv.FusedVariant(ws, "llama", op, default_configuration(fused.graph, op)),
                        sv.EagerVariant(ws, "llama", op)):  # eager: index_select at the moved index
            variant.build()
            verdict = variant.check()
            assert verdict.passed and verdict.error < 1e-6, (name, type(variant).__name__, str(verdict))
