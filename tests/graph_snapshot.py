"""Operator graphs as JSON, for machines without DaCe (the GPU machine).

``snapshot(graph, operators)`` writes what the kernel generator and the reference executor read
(tensors in graph order, letters, dims, primitives, operators); ``load`` rebuilds it as plain
dataclasses with the same attributes as ``dataflow.graph`` / ``dataflow.operators`` objects.
Two files: ``forward_operators.json`` (each spec's forward graph and operators) and
``training_operators.json`` (the fused training graph and its fused operators).
``tests/test_codegen.py`` / ``tests/test_codegen_training.py`` check that the stored snapshots
equal the live front end wherever DaCe is installed.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

PATH = Path(__file__).parent / "data" / "forward_operators.json"
TRAINING_PATH = Path(__file__).parent / "data" / "training_operators.json"
SPECS = ("bert", "gpt2")


@dataclass(frozen=True)
class TensorInfo:
    name: str
    letters: str
    role: str
    p: float = 0.0


@dataclass(frozen=True)
class Operand:
    tensor: str
    letters: str


@dataclass(frozen=True)
class Primitive:
    name: str
    kind: str
    inputs: tuple
    output: Operand
    expr: str

    @property
    def letters(self) -> str:
        seen = dict.fromkeys(self.output.letters)
        for operand in self.inputs:
            seen.update(dict.fromkeys(operand.letters))
        return "".join(seen)

    @property
    def reduced(self) -> str:
        return "".join(l for l in self.letters if l not in self.output.letters)


@dataclass
class Graph:
    tensors: dict
    primitives: list
    letter_dims: dict
    dim_values: dict
    outputs: list = field(default_factory=list)

    def size(self, letters: str) -> int:
        """Number of elements over ``letters`` (as ``PrimitiveGraph.size``)."""
        total = 1
        for letter in letters:
            total *= self.dim_values[self.letter_dims[letter]]
        return total

    def with_dims(self, dim_values: dict) -> "Graph":
        return Graph(self.tensors, self.primitives, self.letter_dims, dict(dim_values), self.outputs)


@dataclass(frozen=True)
class Operator:
    name: str
    cls: str
    phase: str
    primitives: tuple
    inputs: tuple
    outputs: tuple


def _prim(p) -> dict:
    return {"name": p.name, "kind": p.kind, "expr": p.expr, "output": [p.output.tensor, p.output.letters],
            "inputs": [[o.tensor, o.letters] for o in p.inputs]}


def snapshot(graph, operators) -> dict:
    return {"tensors": {n: [t.letters, t.role, t.p] for n, t in graph.tensors.items()},
            "tensor_order": list(graph.tensors),  # graph order: dropout offsets follow it
            "letter_dims": dict(graph.letter_dims), "dim_values": dict(graph.dim_values),
            "outputs": list(graph.outputs), "primitives": [_prim(p) for p in graph.primitives],
            "operators": [{"name": o.name, "cls": o.cls, "phase": o.phase, "inputs": list(o.inputs),
                           "outputs": list(o.outputs), "primitives": [p.name for p in o.primitives]}
                          for o in operators]}


def load(data: dict) -> tuple[Graph, list[Operator]]:
    prims = [Primitive(p["name"], p["kind"], tuple(Operand(*o) for o in p["inputs"]), Operand(*p["output"]), p["expr"])
             for p in data["primitives"]]
    by_name = {p.name: p for p in prims}
    order = data.get("tensor_order", list(data["tensors"]))
    graph = Graph({n: TensorInfo(n, *data["tensors"][n]) for n in order}, prims, data["letter_dims"],
                  data["dim_values"], data["outputs"])
    ops = [Operator(o["name"], o["cls"], o["phase"], tuple(by_name[n] for n in o["primitives"]),
                    tuple(o["inputs"]), tuple(o["outputs"])) for o in data["operators"]]
    return graph, ops


def stored(path: Path = PATH) -> dict:
    """{spec name: (graph, operators)} from a stored snapshot (``PATH`` or ``TRAINING_PATH``)."""
    return {name: load(data) for name, data in json.loads(path.read_text()).items()}


def _config(name: str) -> Path:
    return Path(__file__).parent.parent / "configs" / f"{name}.py"


def live() -> dict:
    """{spec name: snapshot dict} of the forward graphs from the front end (needs DaCe)."""
    from dataflow.operators import group_operators
    from dataflow.pipeline import forward_graph
    result = {}
    for name in SPECS:
        _, graph = forward_graph(_config(name))
        result[name] = snapshot(graph, group_operators(graph, "forward"))
    return result


def live_training() -> dict:
    """{spec name: snapshot dict} of the fused training graphs from the front end (needs DaCe)."""
    from dataflow.pipeline import analyse_spec
    result = {}
    for name in SPECS:
        fused = analyse_spec(_config(name)).fused
        result[name] = snapshot(fused.graph, fused.operators)
    return result


def _dump(data: dict) -> str:
    return json.dumps(data, indent=1, sort_keys=True) + "\n"


if __name__ == "__main__":  # refresh: python -m tests.graph_snapshot
    PATH.write_text(_dump(live()))
    TRAINING_PATH.write_text(_dump(live_training()))
