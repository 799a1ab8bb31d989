"""What the fused-operator sweep needs beyond the fused training graph, as JSON (no DaCe needed).

The fused training graph and its operators come from ``tests.graph_snapshot``
(``training_operators.json``); this module stores beside them (``fused_extras.json``), per spec:

- ``merged``: fused operator -> names of the unfused training operators it replaces;
- ``closed_forms``: the normalizations ``dataflow.autodiff`` recognised structurally, each with
  ``kind`` ("softmax" / "layernorm"), its forward core primitives (``forward``), the backward
  primitives derived from it in closed form (``backward``), ``input`` x, ``output`` (softmax
  probabilities / layernorm's normalised xhat), ``reduced`` (the normalised letters, in the
  letters of ``input``'s spec order), ``scale`` (layernorm: the tensor of sqrt(var + eps), or of
  its inverse when ``inverted``) and ``eps`` (layernorm).

``stored()`` loads both files; ``live()`` rebuilds the extras from the front end (needs DaCe);
``python -m tests.fused_snapshot`` refreshes it.  ``tests/test_fused_sweep.py`` checks that the
stored snapshot equals the live front end wherever DaCe is installed.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from dataflow.graph import PrimitiveGraph
from tests import graph_snapshot

PATH = Path(__file__).parent / "data" / "fused_extras.json"


@dataclass(frozen=True)
class ClosedForm:
    kind: str
    forward: tuple
    backward: tuple
    input: str
    output: str
    reduced: str
    scale: str | None
    inverted: bool
    eps: float | None


@dataclass
class FusedTraining:
    """A loaded fused training graph (duck-typed like ``dataflow.fusion.FusedGraph``'s parts)."""

    graph: PrimitiveGraph
    operators: list  # every fused operator in execution order (contractions included)
    merged: dict
    closed_forms: list

    def with_dims(self, dims: dict) -> "FusedTraining":
        """The same graph at other sizes (``dims`` may name dims of other graphs; they are ignored)."""
        values = {name: dims.get(name, value) for name, value in self.graph.dim_values.items()}
        return FusedTraining(self.graph.with_dims(values), self.operators, self.merged, self.closed_forms)


def _eps(training, form) -> float | None:
    """Layernorm's epsilon: the constant added to the variance inside its core."""
    if form.kind != "layernorm":
        return None
    prims = {p.name: p for p in training.graph.primitives}
    producer = {p.output.tensor: p for p in training.graph.primitives}
    sqrt = producer[form.scale]
    while sqrt.kind == "map" and "sqrt" not in sqrt.expr:  # the inverted form: 1 / sqrt(...)
        sqrt = producer[sqrt.inputs[0].tensor]
    plus = producer[sqrt.inputs[0].tensor]
    assert plus.name in prims and plus.expr.startswith("in0 + "), plus.expr
    return float(plus.expr.removeprefix("in0 + "))


def snapshot_fused(analysis) -> dict:
    """The extras of one spec's ``dataflow.pipeline.Analysis``."""
    fused, training = analysis.fused, analysis.training
    data = {}
    data["merged"] = {name: list(members) for name, members in fused.merged.items()}
    producer = {p.output.tensor: p for p in training.graph.primitives}
    forms = []
    for form in training.closed_forms:
        target = producer[form.output]
        x_letters = next(o.letters for n in form.members for p in training.graph.primitives if p.name == n
                         for o in p.inputs if o.tensor == form.input)
        own = training.graph.tensors[form.input].letters
        reduced = "".join(own[x_letters.index(l)] for l in form.reduced)
        forms.append({"kind": form.kind, "forward": list(form.members), "backward": list(training.derived.get(target.name, ())),
                      "input": form.input, "output": form.output, "reduced": reduced, "scale": form.scale,
                      "inverted": form.inverted, "eps": _eps(training, form)})
    data["closed_forms"] = forms
    return data


def load(graph_data: dict, data: dict) -> FusedTraining:
    graph, operators = graph_snapshot.load(graph_data)
    forms = [ClosedForm(f["kind"], tuple(f["forward"]), tuple(f["backward"]), f["input"], f["output"], f["reduced"],
                        f["scale"], f["inverted"], f["eps"]) for f in data["closed_forms"]]
    return FusedTraining(graph, operators, {k: tuple(v) for k, v in data["merged"].items()}, forms)


def stored() -> dict[str, FusedTraining]:
    """{spec name: FusedTraining} from the stored snapshots."""
    graphs = json.loads(graph_snapshot.TRAINING_PATH.read_text())
    return {name: load(graphs[name], data) for name, data in json.loads(PATH.read_text()).items()}


def live() -> dict:
    """{spec name: extras dict} from the front end (needs DaCe)."""
    from dataflow.pipeline import analyse_spec
    configs = Path(__file__).parent.parent / "configs"
    return {name: snapshot_fused(analyse_spec(configs / f"{name}.py")) for name in graph_snapshot.SPECS}


if __name__ == "__main__":  # refresh: python -m tests.fused_snapshot
    PATH.write_text(json.dumps(live(), indent=1, sort_keys=True) + "\n")
