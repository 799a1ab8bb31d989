"""Operator graphs as JSON, for machines without DaCe (the GPU machine).

``snapshot(graph, operators)`` writes what the kernel generator and the reference executor read
(tensors in graph order, letters, dims, primitives, operators); ``load`` rebuilds the
``dataflow.graph`` / ``dataflow.operators`` objects (which need no DaCe).  Three files under
``snapshots/``: ``forward_operators.json`` (each spec's forward graph and operators),
``training_operators.json`` (the fused training graph and its fused operators) and
``fused_extras.json`` (what the fused-operator sweep needs beyond them, ``FusedTraining``:
``merged``, fused operator -> the unfused training operators it replaces; ``closed_forms``, the
normalizations ``dataflow.autodiff`` recognised, with kind, forward core and closed-form
backward primitives, input, output, reduced letters, scale tensor and epsilon).
``live*()`` rebuild each from the front end (needs DaCe); tests check the stored files against
them wherever DaCe is installed; ``python -m datamove.dataflow.snapshot`` refreshes all three.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from datamove.dataflow.expression import Binary, Constant, Input
from datamove.dataflow.graph import Operand, Primitive, PrimitiveGraph, TensorInfo
from datamove.dataflow.operators import Operator

PATH = Path(__file__).parent / "snapshots" / "forward_operators.json"
TRAINING_PATH = Path(__file__).parent / "snapshots" / "training_operators.json"
FUSED_PATH = Path(__file__).parent / "snapshots" / "fused_extras.json"
SPECS = ("bert", "gpt2")


def _prim(p) -> dict:
    return {"name": p.name, "kind": p.kind, "expr": p.expr, "output": [p.output.tensor, p.output.letters],
            "inputs": [[o.tensor, o.letters] for o in p.inputs]}


def snapshot(graph, operators) -> dict:
    return {"tensors": {n: [t.letters, t.role, t.p] + ([t.value] if getattr(t, "value", "") else [])
                        for n, t in graph.tensors.items()},  # a known constant's value: see TensorInfo
            "tensor_order": list(graph.tensors),  # graph order: dropout offsets follow it
            "letter_dims": dict(graph.letter_dims), "dim_values": dict(graph.dim_values),
            "outputs": list(graph.outputs), "primitives": [_prim(p) for p in graph.primitives],
            "operators": [{"name": o.name, "cls": o.cls, "phase": o.phase, "inputs": list(o.inputs),
                           "outputs": list(o.outputs), "primitives": [p.name for p in o.primitives]}
                          for o in operators]}


def load(data: dict) -> tuple[PrimitiveGraph, list[Operator]]:
    prims = [Primitive(p["name"], p["kind"], tuple(Operand(*o) for o in p["inputs"]), Operand(*p["output"]), p["expr"])
             for p in data["primitives"]]
    by_name = {p.name: p for p in prims}
    order = data.get("tensor_order", list(data["tensors"]))
    graph = PrimitiveGraph({n: TensorInfo(n, *data["tensors"][n]) for n in order}, prims, data["letter_dims"],
                  data["dim_values"], data["outputs"])
    ops = [Operator(o["name"], o["cls"], o["phase"], tuple(by_name[n] for n in o["primitives"]),
                    tuple(o["inputs"]), tuple(o["outputs"])) for o in data["operators"]]
    return graph, ops


def stored(path: Path = PATH) -> dict:
    """{spec name: (graph, operators)} from a stored snapshot (``PATH`` or ``TRAINING_PATH``)."""
    return {name: load(data) for name, data in json.loads(path.read_text()).items()}


def _config(name: str) -> Path:
    return Path(__file__).parents[2] / "configs" / f"{name}.py"


def live() -> dict:
    """{spec name: snapshot dict} of the forward graphs from the front end (needs DaCe)."""
    from datamove.dataflow.operators import group_operators
    from datamove.dataflow.pipeline import forward_graph
    result = {}
    for name in SPECS:
        _, graph = forward_graph(_config(name))
        result[name] = snapshot(graph, group_operators(graph, "forward"))
    return result


def live_training() -> dict:
    """{spec name: snapshot dict} of the fused training graphs from the front end (needs DaCe)."""
    from datamove.dataflow.pipeline import analyse_spec
    result = {}
    for name in SPECS:
        fused = analyse_spec(_config(name)).fused
        result[name] = snapshot(fused.graph, fused.operators)
    return result


def _dump(data: dict) -> str:
    return json.dumps(data, indent=1, sort_keys=True) + "\n"


# --- what the fused-operator sweep needs beyond the graph (fused_extras.json) -----------------

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
    while sqrt.kind == "map" and "sqrt" not in sqrt.expression.functions:  # the inverted form: 1 / sqrt(...)
        sqrt = producer[sqrt.inputs[0].tensor]
    plus = producer[sqrt.inputs[0].tensor]
    tree = plus.expression  # in0 + eps
    assert plus.name in prims and isinstance(tree, Binary) and tree.op == "+" and tree.left == Input(0) \
        and isinstance(tree.right, Constant), plus.expr
    return float(tree.right.value)


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


def load_fused(graph_data: dict, data: dict) -> FusedTraining:
    graph, operators = load(graph_data)
    forms = [ClosedForm(f["kind"], tuple(f["forward"]), tuple(f["backward"]), f["input"], f["output"], f["reduced"],
                        f["scale"], f["inverted"], f["eps"]) for f in data["closed_forms"]]
    return FusedTraining(graph, operators, {k: tuple(v) for k, v in data["merged"].items()}, forms)


def stored_fused() -> dict[str, FusedTraining]:
    """{spec name: FusedTraining} from the stored snapshots."""
    graphs = json.loads(TRAINING_PATH.read_text())
    return {name: load_fused(graphs[name], data) for name, data in json.loads(FUSED_PATH.read_text()).items()}


def live_fused() -> dict:
    """{spec name: extras dict} from the front end (needs DaCe)."""
    from datamove.dataflow.pipeline import analyse_spec
    return {name: snapshot_fused(analyse_spec(_config(name))) for name in SPECS}


if __name__ == "__main__":  # refresh after a front-end change: python -m datamove.dataflow.snapshot
    PATH.write_text(_dump(live()))
    TRAINING_PATH.write_text(_dump(live_training()))
    FUSED_PATH.write_text(_dump(live_fused()))
