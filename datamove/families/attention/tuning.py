"""The fused attention's tuning: the cases the main job measures (``attention_setups``) and how
(``measure``): every configuration of the fused kernels a plan can run (``variants.config_variants``
with ``candidates.PLANNED_MASK_OPTIONS``: the dropout mask regenerated in the backward) and cuDNN's
attention where it takes the case (``variants.library_variants``) at each setup, then, where the
bias add before it folds in, the fastest fused configurations again with the biases added.
"""
from __future__ import annotations

from dataclasses import replace

from datamove.families.attention.candidates import PLANNED_MASK_OPTIONS
from datamove.families.attention.pattern import AttentionPattern, projection_layout
from datamove.families.attention.variants import (AttentionCase, Workspace, biased_variants, config_variants,
                                                  library_variants)

BIASED_ATTENTION_CONFIGS = 4  # per direction: the fastest attention configurations measured again with Q/K/V biases
LIBRARY_ORDERS = ("bjhp",)  # cuDNN's attention measured in these storage orders too: [B, L, H, P], a projection's output


def attention_setups(fused, pattern: AttentionPattern) -> list[dict]:
    """``AttentionCase`` arguments of the graph's fused attention (``pattern``) in the spec's layout
    of its inputs and in the one its Q projection writes as a plain GEMM (``projection_layout``,
    where that differs), and ``bias``: whether the bias add before it folds in (``attention_bias``;
    the tuning measures that too).  With grouped-query attention (``attention_repeats``) each
    layout first grouped (``KV``: K/V heads, read in place), then over K/V repeated (the candidate
    the selection falls back to)."""
    graph, roles, bias, repeats = fused.graph, pattern.roles, pattern.bias, pattern.repeats
    letters = roles.letters
    kernel = {letters["batch"]: "b", letters["heads"]: "h", letters["rows"]: "j", letters["features"]: "p"}
    spec_order = graph.tensors[roles.tensors["q"]].letters
    orders = dict.fromkeys(x for x in (spec_order, projection_layout(fused, roles, bias)) if x)
    mask = roles.tensors["mask"]
    kv_heads = [{"KV": graph.size(repeats.letter)}, {}] if repeats is not None else [{}]
    return [dict(B=graph.size(letters["batch"]), H=graph.size(letters["heads"]), L=graph.size(letters["rows"]),
                 P=graph.size(letters["features"]), dropout_p=graph.tensors[mask].p if mask else 0.0,
                 layout="".join(kernel[x] for x in q), bias=bias is not None, causal=roles.causal is not None, **kv)
            for q in orders for kv in kv_heads]


STAGE = "attention: fused configurations, cuDNN's"  # the tuning's stage (``datamove.tuning.StageCost``)


def measure(tuner, setups: list[dict], dtype) -> None:
    """Every configuration of the fused kernels a plan can run, and cuDNN's attention where it takes the case, at
    each of ``setups`` (``attention_setups``) through ``tuner`` (``datamove.tuning.Tuner``), from
    CUDA graphs; where a setup's ``bias`` says the bias add folds in, the ``BIASED_ATTENTION_CONFIGS``
    fastest of each direction again, adding the biases.  cuDNN's also in ``LIBRARY_ORDERS`` (two
    variants each, a few seconds): the selection may then keep q, o and their gradients where the
    projections write them."""
    measured, library_cases = set(), {}
    for setup in setups:
        setup = dict(setup)
        biased = setup.pop("bias", False)
        workspace = Workspace(AttentionCase(**setup, dtype=dtype), "cuda")
        measured.add(workspace.case)
        variants = config_variants(workspace, PLANNED_MASK_OPTIONS)
        tuner.measure(variants + library_variants(workspace), stage=STAGE, cuda_graph=True)
        if biased:
            tuner.measure(biased_variants(tuner.ranker.ranked(variants), BIASED_ATTENTION_CONFIGS), stage=STAGE,
                          cuda_graph=True)
        for order in LIBRARY_ORDERS:
            library_cases.setdefault(replace(workspace.case, layout=order), None)
    tuner.measure([v for case in library_cases if case not in measured
                   for v in library_variants(Workspace(case, "cuda"))], stage=STAGE, cuda_graph=True)
