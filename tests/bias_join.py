"""BERT's two FFN bias gradients as one operator of two parts, as the fusion's
``JoinReductionAcrossContraction`` made it before the FFN output's (``d_b2``) stayed beside the
layernorm backward that writes ``d_ffn`` (``dataflow.fusion._sums_columns_of``): the subject of the
tests of operators of several parts that read a dropout mask, and of a gradient epilogue whose
consumer has another part (run after the GEMM: ``families.gradient_epilogue``'s rest)."""
from dataclasses import replace

from datamove.dataflow.operators import NORMALIZATION, make_operator


def joined_bias_gradients(graph, operators: list) -> list:
    """``operators`` (a fused BERT graph's, in order) with ``d_b2`` merged into ``d_b1`` (named
    ``d_b1``, parts: d_b2's then d_b1's) and dropped from its own place."""
    ops = {op.name: op for op in operators}
    joined = make_operator(graph, [*ops["d_b2"].primitives, *ops["d_b1"].primitives], ops["d_b1"].phase,
                           name="d_b1", cls=NORMALIZATION)
    return [joined if op.name == "d_b1" else op for op in operators if op.name != "d_b2"]


def with_joined_bias_gradients(fused):
    """A ``dataflow.snapshot.FusedTraining`` of BERT with ``joined_bias_gradients``."""
    merged = {**{k: v for k, v in fused.merged.items() if k != "d_b2"},
              "d_b1": (*fused.merged["d_b2"], *fused.merged["d_b1"])}
    return replace(fused, operators=joined_bias_gradients(fused.graph, fused.operators), merged=merged)
