"""The stages of ``optimize-layer`` chained: spec -> SDFG -> primitive graph (every einsum a GEMM,
``dataflow.einsum_split``) -> operators ->
training graph (with cheap element-wise forward values recomputed in the backward,
``dataflow.recompute``) -> fused graph -> analysis."""
from __future__ import annotations

from dataclasses import asdict, dataclass

from datamove.dataflow.analysis import (OperatorRow, analyse, format_fused_table, format_movement, format_table, fused_json,
                               movement_summary, report_json)
from datamove.dataflow.autodiff import TrainingGraph, build_training_graph
from datamove.dataflow.attention import AttentionCandidate, attention_candidates
from datamove.dataflow.einsum_split import split_einsums
from datamove.dataflow.fusion import FusedGraph, fuse
from datamove.dataflow.graph import PrimitiveGraph
from datamove.dataflow.lowering.lowered_module import lower_spec, spec_line
from datamove.dataflow.operators import Operator, group_operators
from datamove.dataflow.recompute import recompute_elementwise
from datamove.dataflow.sdfg import build_sdfg
from datamove.dataflow.sdfg_reader import walk_sdfg
from datamove.dataflow.spec import LayerSpec, SpecError, load_spec


@dataclass
class Analysis:
    """``graph`` / ``operators`` / ``rows``: the forward pass on its own; ``training_rows``: the
    unfused training operators (forward then backward, counted in the training graph, so forward
    operators also output what the backward reads); ``training``: the derived training graph with
    ``dataflow.recompute``'s copies in its backward, the graph ``fused`` fuses; ``fused_rows``: the
    fused training graph."""

    spec: LayerSpec
    graph: PrimitiveGraph
    operators: list[Operator]
    rows: list[OperatorRow]
    training: TrainingGraph
    training_rows: list[OperatorRow]
    fused: FusedGraph
    fused_rows: list[OperatorRow]
    attention: list[AttentionCandidate]

    @property
    def movement(self) -> dict:
        return movement_summary(self.training_rows, self.fused_rows)

    @property
    def table(self) -> str:
        return "\n\n".join([format_table(self.training_rows), format_fused_table(self.fused_rows, self.fused.merged),
                             format_movement(self.movement)])

    @property
    def json(self) -> dict:
        return report_json(self.spec, self.training.graph, self.training_rows,
                           fused_json(self.fused_rows, self.fused.merged, self.fused.rules, self.fused.stacks),
                           self.movement, [asdict(c) for c in self.attention])


def forward_graph(path, dims: dict[str, int] | None = None, options: dict[str, str] | None = None
                  ) -> tuple[LayerSpec, PrimitiveGraph]:
    """Load a spec and read its SDFG into the forward primitive graph."""
    spec = loaded_spec(path, dims, options)
    return spec, spec_graph(spec)


def loaded_spec(path, dims: dict[str, int] | None = None, options: dict[str, str] | None = None) -> LayerSpec:
    """The spec file at ``path`` loaded with ``dims`` / ``options`` and lowered to what DaCe reads."""
    return lower_spec(load_spec(path, dims, options))


def spec_graph(spec: LayerSpec) -> PrimitiveGraph:
    """A loaded spec's forward primitive graph, read from its SDFG (DaCe's parse: seconds), its
    einsums that are no GEMM rewritten (``dataflow.einsum_split``)."""
    sdfg, einsums = build_sdfg(spec)
    graph = split_einsums(walk_sdfg(spec, sdfg, einsums))
    _check_weights_read(spec, graph)
    return graph


def _check_weights_read(spec: LayerSpec, graph: PrimitiveGraph) -> None:
    """Refuse an argument with a gradient that the forward never reads (its gradient, all zeros, has
    no operator to compute it), naming the ``def`` line; an unread constant or mask is left alone."""
    read = {op.tensor for p in graph.primitives for op in p.inputs}
    unread = [a.name for a in spec.arguments if a.kind == "tensor" and a.requires_grad and not a.value
              and a.name not in read]
    if unread:
        under = f" with {', '.join(f'{k}={v}' for k, v in spec.options.items())}" if spec.options else ""
        raise SpecError(f"{_def_line(spec)}: {spec.name} does not use its "
                        f"argument{'s' if len(unread) > 1 else ''} {', '.join(unread)}{under}: remove "
                        f"{'them' if len(unread) > 1 else 'it'} from the signature, or use "
                        f"{'them' if len(unread) > 1 else 'it'} in the layer")


def _check_gradients(spec: LayerSpec, training: TrainingGraph) -> None:
    """Refuse an argument with a gradient whose gradient is 0 wherever the layer reads it (only in a
    condition of np.where, or times 0): autodiff derives none, so the layer would have none to give."""
    inputs = [t for t, info in training.graph.tensors.items() if info.role == "input"]
    for name in (t for t in inputs if t not in training.input_grads):
        letters = training.graph.tensors[name].letters
        raise SpecError(f"{_def_line(spec)}: argument {name} has no gradient: {spec.name} reads it only where its "
                        f"gradient is 0 (a condition of np.where, a product by 0); declare it "
                        f"Tensor({letters!r}, requires_grad=False), a constant, or use it in the computation")


def _def_line(spec: LayerSpec) -> str:
    """``file:line`` of the layer function's ``def`` in the spec (not of its lowered copy)."""
    code = spec.function.__code__
    _, line = spec_line(code.co_filename, code.co_firstlineno) or (None, code.co_firstlineno)
    return f"{spec.path}:{line}"


def analyse_spec(path, dims: dict[str, int] | None = None, options: dict[str, str] | None = None) -> Analysis:
    return analyse_loaded(loaded_spec(path, dims, options))


def analyse_loaded(spec: LayerSpec) -> Analysis:
    """A loaded spec (``loaded_spec``) analysed: forward graph, training graph, fused graph, their rows."""
    graph = spec_graph(spec)
    operators = group_operators(graph, "forward")
    training = build_training_graph(graph)
    _check_gradients(spec, training)
    training = recompute_elementwise(training)
    fused = fuse(training)
    return Analysis(spec, graph, operators, analyse(graph, operators), training, analyse(training.graph, fused.unfused),
                    fused, analyse(fused.graph, fused.operators), attention_candidates(fused))
