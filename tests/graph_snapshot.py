"""Operator graphs as JSON, for machines without DaCe (the GPU machine).

``snapshot(graph, operators)`` writes what the kernel generator and the reference executor read
(tensors in graph order, letters, dims, primitives, operators); ``load`` rebuilds the
``dataflow.graph`` / ``dataflow.operators`` objects (which need no DaCe).
Two files: ``forward_operators.json`` (each spec's forward graph and operators) and
``training_operators.json`` (the fused training graph and its fused operators).
``tests/test_codegen.py`` / ``tests/test_codegen_training.py`` check that the stored snapshots
equal the live front end wherever DaCe is installed.
"""
from __future__ import annotations

import json
from pathlib import Path

from dataflow.graph import Operand, Primitive, PrimitiveGraph, TensorInfo
from dataflow.operators import Operator

PATH = Path(__file__).parent / "data" / "forward_operators.json"
TRAINING_PATH = Path(__file__).parent / "data" / "training_operators.json"
SPECS = ("bert", "gpt2")


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
