"""The stages of ``optimize-layer`` chained: spec -> SDFG -> primitive graph -> operators -> analysis."""
from __future__ import annotations

from dataclasses import dataclass

from dataflow.analysis import OperatorRow, analyse, format_table, report_json
from dataflow.graph import PrimitiveGraph, walk_sdfg
from dataflow.operators import Operator, group_operators
from dataflow.sdfg import build_sdfg
from dataflow.spec import LayerSpec, load_spec


@dataclass
class Analysis:
    spec: LayerSpec
    graph: PrimitiveGraph
    operators: list[Operator]
    rows: list[OperatorRow]

    @property
    def table(self) -> str:
        return format_table(self.rows)

    @property
    def json(self) -> dict:
        return report_json(self.spec, self.graph, self.rows)


def forward_graph(path, dims: dict[str, int] | None = None, options: dict[str, str] | None = None
                  ) -> tuple[LayerSpec, PrimitiveGraph]:
    """Load a spec and read its SDFG into the forward primitive graph."""
    spec = load_spec(path, dims, options)
    sdfg, einsums = build_sdfg(spec)
    return spec, walk_sdfg(spec, sdfg, einsums)


def analyse_spec(path, dims: dict[str, int] | None = None, options: dict[str, str] | None = None) -> Analysis:
    spec, graph = forward_graph(path, dims, options)
    operators = group_operators(graph, "forward")
    return Analysis(spec, graph, operators, analyse(graph, operators))
