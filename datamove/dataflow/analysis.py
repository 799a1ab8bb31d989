"""Exact per-operator analysis: flop, distinct input/output elements, flop/IO, class totals.

Element counts are of distinct elements (each element of each tensor once), so they are the
minimal I/O of an operator; Table III of the paper reports the same quantities (Gflop = 2^30 flop,
elements in 1e6).
"""
from __future__ import annotations

from dataclasses import dataclass

from datamove.dataflow.graph import PrimitiveGraph
from datamove.dataflow.operators import CONTRACTION, ELEMENTWISE, NORMALIZATION, Operator, operator_counts
from datamove.dataflow.spec import LayerSpec

CLASSES = (CONTRACTION, NORMALIZATION, ELEMENTWISE)


@dataclass
class OperatorRow:
    """One operator's analysis, as written to JSON."""

    operator: Operator
    flop: int
    input_elements: int
    output_elements: int

    @property
    def flop_per_io(self) -> float:
        return self.flop / max(1, self.input_elements + self.output_elements)

    def as_json(self) -> dict:
        op = self.operator
        return {"name": op.name, "class": op.cls, "phase": op.phase, "flop": self.flop,
                "input_elements": self.input_elements, "output_elements": self.output_elements,
                "flop_per_io": round(self.flop_per_io, 4), "inputs": list(op.inputs), "outputs": list(op.outputs),
                "letters": op.letters, "reduced_letters": op.reduced,
                "primitives": [p.kind if p.kind != "einsum" else f"einsum {p.expr}" for p in op.primitives]}


def analyse(graph: PrimitiveGraph, operators: list[Operator]) -> list[OperatorRow]:
    return [OperatorRow(op, **operator_counts(graph, op)) for op in operators]


def class_totals(rows: list[OperatorRow]) -> dict[str, dict[str, int]]:
    """Sums of flop and element counts per (phase, class)."""
    totals: dict[str, dict[str, int]] = {}
    for row in rows:
        key = f"{row.operator.phase}/{row.operator.cls}"
        entry = totals.setdefault(key, {"operators": 0, "flop": 0, "input_elements": 0, "output_elements": 0})
        entry["operators"] += 1
        entry["flop"] += row.flop
        entry["input_elements"] += row.input_elements
        entry["output_elements"] += row.output_elements
    return totals


def data_movement(rows: list[OperatorRow]) -> dict[str, int]:
    """Minimal data movement (elements in + out, summed over operators): in total, of the
    non-contraction operators, and per phase."""
    moved = lambda keep: sum(r.input_elements + r.output_elements for r in rows if keep(r.operator))  # noqa: E731
    result = {"total": moved(lambda op: True), "non_contraction": moved(lambda op: op.cls != CONTRACTION)}
    for phase in dict.fromkeys(r.operator.phase for r in rows):
        result[phase] = moved(lambda op: op.phase == phase)
    return result


def movement_summary(unfused: list[OperatorRow], fused: list[OperatorRow]) -> dict:
    """Unfused vs fused data movement and the reduction in percent."""
    before, after = data_movement(unfused), data_movement(fused)
    return {"unfused": before, "fused": after,
            "reduction_percent": {key: round(100 * (1 - after[key] / before[key]), 2) for key in before if before[key]}}


def fused_json(rows: list[OperatorRow], merged: dict[str, tuple[str, ...]], rules: dict[str, tuple[str, ...]],
               stacks: dict) -> list[dict]:
    """The fused operators: ``members`` are the unfused operators each one merges."""
    result = []
    for row in rows:
        op = row.operator
        entry = {"name": op.name, "members": list(merged[op.name]), "class": op.cls, "phase": op.phase,
                 "input_elements": row.input_elements, "output_elements": row.output_elements, "flop": row.flop,
                 "inputs": list(op.inputs), "outputs": list(op.outputs), "rules": list(rules[op.name]),
                 "primitives": [p.name for p in op.primitives]}
        if op.name in stacks:
            stack = stacks[op.name]
            entry["stack"] = {"letter": stack.letter, "size": stack.size, "expr": stack.expr,
                              "tensors": [list(t) for t in stack.tensors]}
        result.append(entry)
    return result


def report_json(spec: LayerSpec, graph: PrimitiveGraph, rows: list[OperatorRow], fused: list[dict] | None = None,
                movement: dict | None = None, attention: list[dict] | None = None) -> dict:
    """The analysis as JSON; ``fused``, ``movement`` and ``attention`` (candidates) when given."""
    report = {
        "spec": str(spec.path), "layer": spec.name, "options": spec.options,
        "dims": dict(graph.dim_values), "letters": dict(graph.letter_dims),
        "tensors": {name: {"letters": t.letters, "role": t.role, **({"p": t.p} if t.role == "dropout" else {})}
                    for name, t in graph.tensors.items()},
        "operators": [row.as_json() for row in rows],
        "totals": class_totals(rows),
    }
    if fused is not None:
        report["fused"] = fused
    if movement is not None:
        report["data_movement"] = movement
    if attention is not None:
        report["attention_candidates"] = attention
    return report


def format_table(rows: list[OperatorRow]) -> str:
    """A readable table: Gflop in 2^30 flop, elements in 1e6, as the paper's Table III."""
    lines = [f"{'operator':30s} {'class':13s} {'phase':8s} {'Gflop':>9s} {'in (1e6)':>9s} {'out (1e6)':>9s} "
             f"{'flop/IO':>8s}"]
    for row in rows:
        op = row.operator
        lines.append(f"{op.name[:30]:30s} {op.cls:13s} {op.phase:8s} {row.flop / 2**30:9.3f} "
                     f"{row.input_elements / 1e6:9.2f} {row.output_elements / 1e6:9.2f} {row.flop_per_io:8.2f}")
    lines.append("")
    for key, entry in class_totals(rows).items():
        lines.append(f"{key:44s} {entry['operators']:3d} operators {entry['flop'] / 2**30:10.3f} Gflop "
                     f"{(entry['input_elements'] + entry['output_elements']) / 1e6:9.2f} M elements moved")
    return "\n".join(lines)


def format_fused_table(rows: list[OperatorRow], merged: dict[str, tuple[str, ...]]) -> str:
    """The fused operators with the unfused operators each merges (elements in 1e6)."""
    lines = [f"{'fused operator':30s} {'class':13s} {'phase':8s} {'in (1e6)':>9s} {'out (1e6)':>9s}  merges"]
    for row in rows:
        op = row.operator
        members = ", ".join(merged[op.name])
        lines.append(f"{op.name[:30]:30s} {op.cls:13s} {op.phase:8s} {row.input_elements / 1e6:9.2f} "
                     f"{row.output_elements / 1e6:9.2f}  {members if len(members) < 90 else members[:87] + '...'}")
    return "\n".join(lines)


def format_movement(summary: dict) -> str:
    """Unfused vs fused minimal data movement, in 1e6 elements."""
    lines = [f"{'data movement (1e6 elements)':30s} {'unfused':>10s} {'fused':>10s} {'reduction':>10s}"]
    for key, before in summary["unfused"].items():
        after = summary["fused"][key]
        lines.append(f"{key:30s} {before / 1e6:10.2f} {after / 1e6:10.2f} "
                     f"{summary['reduction_percent'].get(key, 0.0):9.2f}%")
    return "\n".join(lines)
