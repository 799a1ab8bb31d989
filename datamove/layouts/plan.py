"""The plan: the configuration chosen for a whole training graph, as data.

The selection (``layouts.select``) writes it; the export and the report read it, and nothing
downstream re-runs the search.  A plan is a list of ``Step``s, one kernel launch each, in
execution order (every forward step, then every backward step), over the tensors of the fused
training graph (``dataflow.fusion.FusedGraph`` / ``dataflow.snapshot.FusedTraining``), named as
there.  A *layout* is an order of a tensor's letters, outermost first (``layouts.space``).

Every tensor held in memory has one layout, ``Plan.layouts[tensor]``: the one its producer writes
(a layer input: the one it is stored in).  A step reads a tensor in ``Step.reads[tensor]``; where
that differs from ``Plan.layouts[tensor]``, an earlier step of kind ``LAYOUT_CHANGE`` made the copy
it reads (a ``LayoutChangeConfig``; the copy lives until its last reader).

``Step.config`` is the step kind's configuration (``layouts.step_config``: ``GeneratedConfig``,
``ContractionConfig`` for ``GEMM`` and ``GEMM_EPILOGUE``, ``AttentionConfig``,
``LayoutChangeConfig``), written in ``plan.json`` in its JSON form.

Times are milliseconds; ``source`` says whether a step's time was measured on this device or
predicted by the cost model (``layouts.cost_model``).
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

from datamove.dtypes import Precision, parse
from datamove.layouts.step_config import (ATTENTION_BACKWARD, ATTENTION_FORWARD, CONFIGS, GEMM, GEMM_EPILOGUE,  # noqa: F401
                                          GENERATED, LAYOUT_CHANGE, StepConfig, config_from_json)

KINDS = tuple(CONFIGS)
MEASURED, PREDICTED = "measured", "predicted"


class PlanNotRunnable(Exception):
    """A plan whose program cannot be built or run forward and backward, found before its artifact
    is written (``datamove.runtime.runnable.check_runnable``): a bug of the selection, whose
    constraints should have kept it runnable.  ``shape``: its call dims, described; ``step``: the
    step that failed (None where no one step did); ``reason``: the error, one line."""

    BLAME = "this is a bug in datamove's selection: please report it"

    def __init__(self, shape: str, step: str | None, reason: str):
        self.shape, self.step, self.reason = shape, step, reason
        where = f"step {step}" if step else "its program"
        super().__init__(f"the plan at {shape} cannot run: {where}: {reason}: {self.BLAME}; no artifact was written")


class PlanPastLimits(PlanNotRunnable):
    """A plan one of whose kernels would launch more programs than CUDA's grid holds, or index an
    operand past its int32 offsets, at its sizes (``kernels.launch.SizeLimitError``): the dims are
    too large for the kernels, not a bug of the selection; said so in the same one line."""

    BLAME = "these dims are past its kernels' limits (CUDA's grid, int32 offsets): give smaller dims (--dims)"


@dataclass(frozen=True)
class Step:
    """One kernel launch of the plan.

    ``name``: unique in the plan; ``phase``: "forward" / "backward"; ``kind``: one of ``KINDS``;
    ``operators``: the fused graph's operators it runs (empty for a layout change);
    ``reads`` / ``writes``: {graph tensor -> layout}; ``config``: the kind's configuration
    (``layouts.step_config``); ``time_ms`` with its ``source`` (``MEASURED`` / ``PREDICTED``)."""

    name: str
    phase: str
    kind: str
    operators: tuple[str, ...]
    reads: dict[str, str]
    writes: dict[str, str]
    config: StepConfig
    time_ms: float
    source: str

    def __post_init__(self):
        if not isinstance(self.config, CONFIGS.get(self.kind, ())):
            raise TypeError(f"step {self.name}: a {self.kind} step's config is a "
                            f"{CONFIGS[self.kind].__name__ if self.kind in CONFIGS else 'known kind'}, "
                            f"not {type(self.config).__name__}")

    def to_json(self) -> dict:
        return {**{k: v for k, v in asdict(self).items() if k != "config"}, "config": self.config.to_json()}

    @classmethod
    def from_json(cls, data: dict) -> "Step":
        return cls(**{**data, "operators": tuple(data["operators"]),
                      "config": config_from_json(data["kind"], data["config"])})


@dataclass
class Plan:
    """A whole training graph's configuration.

    ``spec``: spec name; ``dims``: {dim name -> value}; ``dtype``: a ``dtypes.Precision`` (any spelling is
    taken; ``plan.json`` stores its name, "bfloat16");
    ``device``: the device the times are for; ``timing``: "measured", "predicted" or "mixed";
    ``layouts``: {tensor -> layout} for every tensor held in memory; ``steps``: execution order;
    ``saved``: tensors forward steps write that backward steps read; ``total_ms``: the sum of the
    steps' times; ``best_sum_ms``: the sum over the graph's operators of each one's best candidate
    alone (the paper's comparison); ``search``: the search's size and time (operators,
    candidates, states, edges, seconds)."""

    spec: str
    dims: dict[str, int]
    dtype: Precision
    device: str
    timing: str
    layouts: dict[str, str]
    steps: list[Step]
    saved: list[str]
    total_ms: float
    best_sum_ms: float
    search: dict = field(default_factory=dict)

    def __post_init__(self):
        self.dtype = parse(self.dtype)

    def to_json(self) -> dict:
        return {**{k: v for k, v in asdict(self).items() if k != "steps"}, "dtype": self.dtype.name,
                "steps": [s.to_json() for s in self.steps]}

    @classmethod
    def from_json(cls, data: dict) -> "Plan":
        return cls(**{**data, "steps": [Step.from_json(s) for s in data["steps"]]})

    def dumps(self) -> str:
        return json.dumps(self.to_json(), indent=1)
