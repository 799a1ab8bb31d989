"""The kernel families fused onto training GEMMs, registered in one place.

Each family is one module holding its graph pattern and legality check, its tuning variants, its
selection candidates and its step's launch (``families.base.GemmFamily``).  The tuning
(``datamove.tuning``), the selection (``datamove.candidates``) and the runtime
(``datamove.runtime.steps``) iterate over ``GEMM_FAMILIES``; adding a family is adding its module and
its entry here (``docs/adding-a-kernel.md``).  The order is the selection's: the runs of one GEMM's
families are kept in this order among equals.

A family running a group of operators as steps of its own (``families.base.GraphFamily``: the
fused attention, ``ATTENTION``) is registered in ``GRAPH_FAMILIES``, which the selection iterates
over; ``STEP_LAUNCHERS``: its step kinds' launcher factories (``steps.build_launcher``); the tuning
measures the setups the job finds (``AttentionFamily.setups`` and ``measure``).
"""
from __future__ import annotations

from datamove.families.attention import AttentionFamily
from datamove.families.base import EpilogueLaunch, GemmFamily, GraphFamily
from datamove.families.forward_epilogue import ForwardEpilogueFamily
from datamove.families.gradient_epilogue import GradientEpilogueFamily
from datamove.families.join_epilogue import JoinEpilogueFamily
from datamove.families.residual_add import ResidualAddFamily

GEMM_FAMILIES: tuple[GemmFamily, ...] = (ResidualAddFamily(), ForwardEpilogueFamily(), GradientEpilogueFamily(),
                                         JoinEpilogueFamily())
ATTENTION = AttentionFamily(GEMM_FAMILIES)  # its grouped runs: contiguous in the order the GEMM families set
GRAPH_FAMILIES: tuple[GraphFamily, ...] = (ATTENTION,)
STEP_LAUNCHERS = {kind: factory for family in GRAPH_FAMILIES for kind, factory in family.launchers.items()}


def epilogue_launch(step, graph, ops: dict) -> EpilogueLaunch:
    """The launch of ``step``'s fused epilogue (``ContractionConfig.epilogue``), by the family whose
    step configuration it is; ``ops``: the fused graph's operators by name."""
    epilogue = step.config.epilogue
    family = next((f for f in GEMM_FAMILIES if f.config_type is not None and isinstance(epilogue, f.config_type)), None)
    if family is None:
        raise ValueError(f"{step.name}: no kernel family runs an epilogue of type {type(epilogue).__name__}")
    return family.launch(step, graph, ops)
