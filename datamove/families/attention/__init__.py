"""The fused attention as one kernel family (``families.base.GraphFamily``): flash-attention-style
kernels (``kernels.attention``) running the score contraction, softmax (with dropout and a causal
mask) and output contraction of a fused training graph, forward and backward, as two steps.

- pattern (``pattern``): ``dataflow.attention``'s recogniser with the kernels' head dims, the bias
  add before it that the kernels can take in, grouped-query attention's repeats of K and V;
- tuning (``tuning``, ``variants``): the cases measured and their variants;
- selection (``candidates``): its candidates in every layout the producer of q can write;
- launch (``launch``): the launchers of its ``ATTENTION_FORWARD`` / ``ATTENTION_BACKWARD`` steps,
  and the run-time check of a constant its causal mask stands in for.

``AttentionFamily`` is registered in ``datamove.families`` (``ATTENTION``, ``GRAPH_FAMILIES``)
with the GEMM families, which set the execution order its grouped runs must be contiguous in.
"""
from __future__ import annotations

from datamove.dataflow.attention import AttentionRoles
from datamove.families.attention.candidates import attention_candidates, q_layouts
from datamove.families.attention.launch import LAUNCHERS, check_causal_constant, saved_mask_name
from datamove.families.attention.pattern import (AttentionPattern, AttentionRepeats, attention_bias, attention_repeats,
                                                 attention_roles, projection_layout)
from datamove.families.attention.tuning import attention_setups, measure
from datamove.families.base import GraphFamily, execution_order

__all__ = ["AttentionFamily", "AttentionPattern", "AttentionRepeats", "AttentionRoles", "attention_bias",
           "attention_candidates", "attention_repeats", "attention_roles", "check_causal_constant",
           "projection_layout", "saved_mask_name"]


class AttentionFamily(GraphFamily):
    """The fused attention (module doc); ``gemm_families``: those that set the plan's execution
    order (``families.base.execution_order``)."""

    name = "attention"
    launchers = LAUNCHERS

    def __init__(self, gemm_families: tuple = ()):
        self.gemm_families = tuple(gemm_families)

    def repeats(self, fused, roles: AttentionRoles) -> AttentionRepeats | None:
        """Grouped-query attention around ``roles`` (``attention_repeats``) in the plan's execution order."""
        return attention_repeats(fused, roles, execution_order(fused, self.gemm_families))

    def match(self, fused) -> tuple[AttentionPattern | None, str]:
        roles, why = attention_roles(fused)
        if roles is None:
            return None, why
        return AttentionPattern(roles, attention_bias(fused, roles), self.repeats(fused, roles)), ""

    def setups(self, fused, dtype_name: str = "") -> list[dict]:
        """The cases the tuning measures (``tuning.attention_setups``), none without the attention."""
        pattern, _ = self.match(fused)
        return attention_setups(fused, pattern) if pattern is not None else []

    def measure(self, tuner, setups: list[dict], dtype) -> None:
        measure(tuner, setups, dtype)

    def offer(self, builder, pattern: AttentionPattern, runs: dict, kept) -> dict:
        """Its candidates (through ``builder.attention``, where a caller can wrap what is offered), in
        the runs ``attention_forward`` / ``attention_backward`` and, with the bias add folded in,
        ``<bias operator>+attention_forward+bias``."""
        offered: dict = {}
        for c in builder.attention(pattern.roles, q_layouts(pattern, runs, kept), pattern.bias, pattern.repeats):
            offered.setdefault(c.name + ("+bias" if c.config.bias else ""), []).append(c)
        return offered

    def fact(self, pattern: AttentionPattern | None, why: str) -> str:
        if pattern is None:
            return f"none: {why}"
        roles, repeats = pattern.roles, pattern.repeats
        grouped = "" if repeats is None else (
            f" (and grouped-query: K/V over {repeats.letter}, {repeats.size} query heads each, "
            f"read in place of {roles.tensors['k']} / {roles.tensors['v']})")
        return "fused candidate" + grouped
