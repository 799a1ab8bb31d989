"""The plan: the configuration chosen for a whole training graph, as data.

The selection (``layouts.select``) writes it; the export and the report read it, and nothing
downstream re-runs the search.  A plan is a list of ``Step``s, one kernel launch each, in
execution order (every forward step, then every backward step), over the tensors of the fused
training graph (``dataflow.fusion.FusedGraph`` / ``dataflow.snapshot.FusedTraining``), named as
there.  A *layout* is an order of a tensor's letters, outermost first (``layouts.space``).

Every tensor held in memory has one layout, ``Plan.layouts[tensor]``: the one its producer writes
(a layer input: the one it is stored in).  A step reads a tensor in ``Step.reads[tensor]``; where
that differs from ``Plan.layouts[tensor]``, an earlier step of kind ``LAYOUT_CHANGE`` made the copy
it reads (``config = {"tensor", "from", "to"}``; the copy lives until its last reader).

``Step.config`` by kind:

- ``GENERATED``: ``{"knobs": {...}, "masks": {mask: layout}}``, the knobs of a
  ``layouts.space.Configuration`` whose layouts are ``reads | writes | masks`` (the dropout masks it
  regenerates, never stored); runs one fused element-wise / normalization operator.
- ``GEMM``: ``{"einsum": "phi,ibj->phbj", "backend": "cublas" | "triton", "gemm": {GemmConfig
  fields} | None, "operands": {"a": [tensors], "b": [tensors], "out": [tensors]}}``: each operand
  of the einsum as the list of graph tensors it is made of, one tensor, or for a stacked
  contraction (Q/K/V) the members stacked along the einsum's extra leading letter, in stack order
  (the runtime may reorder an operand stacked on both inputs and summed away).  cuBLAS only:
  ``"algorithm": n`` (absent: 0), the n-th of cuBLASLt's heuristic's algorithms the tuning found
  fastest (``kernels.blas.LtMatmul``); ``"residual": {"consumer", "tensor", "output"}``
  (``harness.contraction_variants.ResidualAdd``): the GEMM adds ``tensor`` (beta 1, stored as the
  output) and writes its consumer's ``output``, covering that consumer too.
- ``GEMM_EPILOGUE``: the ``GEMM`` fields plus ``"epilogue": {"consumer", "bias", "bias_letters",
  "activation", "mask", "p", "save", "produced", "output", "saved"}`` (``harness.contraction_variants
  .FusableEpilogue``): the contraction and its element-wise consumer in one Triton kernel; or
  ``"epilogue": {"consumer", "gradient", "factor", "produced", "output", "summed",
  "sum_letters", "primitives", "rest", "rest_layouts"}`` (``harness.gradient_epilogue.GradientEpilogue``):
  the contraction times an activation's derivative (its scale from the graph's scalars, 1 in
  evaluation mode) and its bias-gradient sums in the Triton kernel
  (and a second that adds the sums), then the consumer's ``rest`` primitives by their generated
  kernel (``layouts.space.rest_part`` in ``rest_configuration`` of ``rest_layouts``).
- ``ATTENTION_FORWARD`` / ``ATTENTION_BACKWARD``: ``{"knobs": {...}, "roles": {"q", "k", "v", "o",
  "mask", "lse"}, "letters": {"batch", "heads", "rows", "keys", "features", "value_features"},
  "scale": float, "causal": bool}``: flash-style attention over the graph's tensors in those roles
  (``lse`` is a tensor of the plan only, over letters batch, heads, rows; ``mask`` a dropout
  tensor or None); the backward's roles add the gradients ``"do"`` (of ``o``), ``"dq"``,
  ``"dk"``, ``"dv"``.  ``knobs``: the kernels' launch knobs (``kernels.attention.attention_configs``).
- ``LAYOUT_CHANGE``: ``{"tensor", "from", "to"}``.

Times are milliseconds; ``source`` says whether a step's time was measured on this device or
predicted by the cost model (``layouts.cost_model``).
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

GENERATED, GEMM, GEMM_EPILOGUE = "generated", "gemm", "gemm_epilogue"
ATTENTION_FORWARD, ATTENTION_BACKWARD, LAYOUT_CHANGE = "attention_forward", "attention_backward", "layout_change"
KINDS = (GENERATED, GEMM, GEMM_EPILOGUE, ATTENTION_FORWARD, ATTENTION_BACKWARD, LAYOUT_CHANGE)
MEASURED, PREDICTED = "measured", "predicted"


@dataclass(frozen=True)
class Step:
    """One kernel launch of the plan.

    ``name``: unique in the plan; ``phase``: "forward" / "backward"; ``kind``: one of ``KINDS``;
    ``operators``: the fused graph's operators it runs (empty for a layout change);
    ``reads`` / ``writes``: {graph tensor -> layout}; ``config``: kind-specific (module doc);
    ``time_ms`` with its ``source`` (``MEASURED`` / ``PREDICTED``)."""

    name: str
    phase: str
    kind: str
    operators: tuple[str, ...]
    reads: dict[str, str]
    writes: dict[str, str]
    config: dict
    time_ms: float
    source: str


@dataclass
class Plan:
    """A whole training graph's configuration.

    ``spec``: spec name; ``dims``: {dim name -> value}; ``dtype``: torch dtype name ("bfloat16");
    ``device``: the device the times are for; ``timing``: "measured", "predicted" or "mixed";
    ``layouts``: {tensor -> layout} for every tensor held in memory; ``steps``: execution order;
    ``saved``: tensors forward steps write that backward steps read; ``total_ms``: the sum of the
    steps' times; ``best_sum_ms``: the sum over the graph's operators of each one's best candidate
    alone (the paper's comparison); ``search``: the search's size and time (operators,
    candidates, states, edges, seconds)."""

    spec: str
    dims: dict[str, int]
    dtype: str
    device: str
    timing: str
    layouts: dict[str, str]
    steps: list[Step]
    saved: list[str]
    total_ms: float
    best_sum_ms: float
    search: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> "Plan":
        steps = [Step(**{**s, "operators": tuple(s["operators"])}) for s in data["steps"]]
        return cls(**{**data, "steps": steps})

    def dumps(self) -> str:
        return json.dumps(self.to_json(), indent=1)
