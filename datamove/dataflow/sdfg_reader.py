"""Read a spec's SDFG into a ``PrimitiveGraph`` (``walk_sdfg``).

Every map becomes a ``Primitive`` of kind ``"map"`` (its tasklet as an expression over in0, in1,
...), every Reduce node one of kind ``"reduce"`` and every einsum (recorded while parsing, see
``dataflow.sdfg``) one of kind ``"einsum"``; the nodes implementing an einsum (library nodes,
views, loop nests) are skipped.  Letters flow from the spec's annotations through einsum strings
and map memlets to every tensor.

Two forms that ``dataflow.lowering`` emits are read specially: ``np.where(a > b, x, y)`` (a
DaCe library node) becomes one map ``where(in0 > in1, in2, in3)``, the comparison inlined; a
one-operand einsum that only permutes letters (``np.einsum("ts->st", k)``, a transpose) is no
primitive: its readers read its operand with permuted letters, so nothing is moved.
"""
from __future__ import annotations

import ast
import linecache
import re
from dataclasses import dataclass, field, replace

import dace
from dace.sdfg import nodes

from datamove.dataflow.expression import FUNCTIONS
from datamove.dataflow.graph import Operand, Primitive, PrimitiveGraph, TensorInfo
from datamove.dataflow.lowering.lowered_module import spec_line
from datamove.dataflow.lowering.support import SUPPORTED
from datamove.dataflow.sdfg import EinsumRecord
from datamove.dataflow.spec import LayerSpec, SpecError

# a tasklet's function -> the map expression's: NumPy's names (DaCe's tasklets call np.exp as exp), and DaCe's own
# spellings of np.maximum, np.minimum and (NumPy 2) np.sign
_FUNCTIONS = {**{name: name for name in FUNCTIONS}, "max": "maximum", "min": "minimum", "sign_numpy_2": "sign"}
_REDUCTIONS = {"x + y": "sum", "max(x, y)": "max"}


def _constant_value(code: str) -> str:
    """``'__out = dace.float32(0.125)'`` -> ``'0.125'``; symbolic values (``N``) stay names."""
    match = re.fullmatch(r"\s*__out\s*=\s*(?:dace\.)?(?:float\d+|int\d+)?\((.*)\)\s*", code) or \
        re.fullmatch(r"\s*__out\s*=\s*(.*)\s*", code)
    return match.group(1).strip()


class _ExpressionRewriter(ast.NodeTransformer):
    """Renames tasklet connectors to in0/in1/... (or inlines constants) and NumPy-izes functions."""

    def __init__(self, names: dict[str, str]):
        self.names = names

    def visit_Name(self, node: ast.Name):
        if node.id in self.names:
            return ast.parse(self.names[node.id], mode="eval").body
        return node

    def visit_Call(self, node: ast.Call):
        self.generic_visit(node)
        if isinstance(node.func, ast.Name) and node.func.id in _FUNCTIONS:
            node.func = ast.Name(_FUNCTIONS[node.func.id], ast.Load())
        elif isinstance(node.func, ast.Name):
            raise SpecError(f"element-wise function {node.func.id}() is not supported; use {', '.join(FUNCTIONS)} "
                            "or arithmetic")
        return node


def _map_expression(code: str, names: dict[str, str]) -> str:
    tree = ast.parse(code)
    if len(tree.body) != 1 or not isinstance(tree.body[0], ast.Assign):
        raise SpecError(f"unsupported element-wise computation: {code!r}")
    value = _ExpressionRewriter(names).visit(tree.body[0].value)
    return ast.unparse(value)


@dataclass
class _RawPrimitive:
    """A primitive before letters are known: operands as (array, per-axis index expressions)."""

    kind: str
    expr: str
    inputs: list[tuple[str, list[str]]]
    output: tuple[str, list[str]]
    params: dict[str, bool] = field(default_factory=dict)  # map parameter -> is a unit (size-1) range
    order: int = 0


def _is_view(sdfg: dace.SDFG, name: str) -> bool:
    return isinstance(sdfg.arrays[name], dace.data.View)


def _einsum_implementations(sdfg, state, outputs) -> tuple[set[int], dict[str, list[str]]]:
    """Nodes that implement the einsums writing ``outputs`` (library nodes, views, maps of a
    loop-nest einsum) and, per einsum output array, the non-view arrays it reads."""
    internal: set[int] = set()
    operands: dict[str, list[str]] = {}
    for root in state.nodes():
        if not (isinstance(root, nodes.AccessNode) and root.data in outputs):
            continue
        found = operands.setdefault(root.data, [])
        stack = [root]
        while stack:
            node = stack.pop()
            for edge in state.in_edges(node):
                src = edge.src
                if isinstance(src, nodes.AccessNode) and not _is_view(sdfg, src.data):
                    if src.data != root.data and src.data not in found:
                        found.append(src.data)
                    continue
                if id(src) in internal:
                    continue
                internal.add(id(src))
                stack.append(src)
                if isinstance(src, nodes.MapExit):  # a loop-nest einsum: take the whole scope
                    entry = state.entry_node(src)
                    for inner in state.scope_subgraph(entry).nodes():
                        if inner is not src and id(inner) not in internal and not isinstance(inner, nodes.AccessNode):
                            internal.add(id(inner))
                            stack.append(inner)
    return internal, operands


def _read_state(sdfg, state, records: dict[str, EinsumRecord], raws: list[_RawPrimitive],
                constants: dict[str, str], aliases: dict[str, str]) -> None:
    scope_children = state.scope_children()
    internal, einsum_operands = _einsum_implementations(sdfg, state, records)
    emitted: set[str] = set()
    for node in state.topological_sort() if hasattr(state, "topological_sort") else state.nodes():
        if id(node) in internal:
            continue
        if isinstance(node, nodes.MapEntry):
            inner = [n for n in scope_children[node] if not isinstance(n, nodes.MapExit)]
            if len(inner) != 1 or not isinstance(inner[0], nodes.Tasklet):
                raise SpecError(f"unsupported map {node.map.label}: only single-statement element-wise maps")
            tasklet = inner[0]
            params = {p: (r[1] - r[0]) == 0 for p, r in zip(node.map.params, node.map.range.ranges)}
            names, inputs = {}, []
            for edge in state.in_edges(tasklet):
                array = edge.data.data
                if array in constants:
                    names[edge.dst_conn] = f"({constants[array]})"
                else:
                    names[edge.dst_conn] = f"in{len(inputs)}"
                    inputs.append((array, [str(r[0]) for r in edge.data.subset.ranges]))
            (out_edge,) = state.out_edges(tasklet)
            expr = _map_expression(tasklet.code.as_string, names)
            raws.append(_RawPrimitive("map", expr, inputs,
                                      (out_edge.data.data, [str(r[0]) for r in out_edge.data.subset.ranges]), params))
        elif isinstance(node, nodes.Tasklet) and state.entry_node(node) is None:
            sources = {edge.dst_conn: edge.data.data for edge in state.in_edges(node)}
            (edge,) = state.out_edges(node)
            if not sources:
                constants[edge.data.data] = _constant_value(node.code.as_string)
            elif all(array in constants for array in sources.values()):  # arithmetic on constants
                names = {conn: f"({constants[array]})" for conn, array in sources.items()}
                constants[edge.data.data] = _map_expression(node.code.as_string, names)
            else:
                raise SpecError(f"unsupported scalar computation {node.label}: use whole-array expressions")
        elif type(node).__name__ == "Reduce":
            kind = _REDUCTIONS.get(node.wcr.split(":", 1)[1].strip())
            if kind is None:
                raise SpecError(f"unsupported reduction {node.wcr}: use np.sum or np.max")
            (in_edge,), (out_edge,) = state.in_edges(node), state.out_edges(node)
            src = in_edge.data.data
            axes = list(node.axes) if node.axes is not None else list(range(len(sdfg.arrays[src].shape)))
            raws.append(_RawPrimitive("reduce", kind, [(src, [str(a) for a in axes])], (out_edge.data.data, [])))
        elif isinstance(node, nodes.LibraryNode) and set(node.in_connectors) == {"_mrg_t", "_mrg_f", "_mrg_mask"}:
            raws.append(_where(sdfg, state, node, raws, constants))
        elif isinstance(node, nodes.AccessNode) and node.data in records:
            if node.data in emitted:
                continue
            upstream = einsum_operands.get(node.data)
            if not upstream:  # this state only initialises the einsum's output
                continue
            emitted.add(node.data)
            record = records[node.data]
            operands = [name if name in upstream else renamed if renamed in upstream else None
                        for name, renamed in zip(record.operands, record.renamed_operands)]
            leftover = [name for name in upstream if name not in operands]
            if operands.count(None) > 1 and len(set(leftover)) > 1:  # their order unknown: never guessed
                raise SpecError(f"np.einsum({record.subscripts!r}) reads {', '.join(leftover)}, which DaCe's "
                                "simplification renamed past recognition, so which operand is which is not known: "
                                "assign each operand to a variable of its own just before the contraction")
            operands = [name if name is not None else leftover.pop(0) for name in operands]
            raws.append(_RawPrimitive("einsum", record.subscripts, [(n, []) for n in operands], (node.data, [])))
        elif isinstance(node, nodes.AccessNode):
            for edge in state.in_edges(node):
                if isinstance(edge.src, nodes.AccessNode) and not _is_view(sdfg, node.data) \
                        and not _is_view(sdfg, edge.src.data):
                    aliases[node.data] = edge.src.data
        elif isinstance(node, nodes.NestedSDFG):
            raise SpecError(f"unsupported construct {node.label}: a call DaCe could not inline")


def _where(sdfg, state, node, raws: list[_RawPrimitive], constants: dict[str, str]) -> _RawPrimitive:
    """``np.where(cond, a, b)`` as one map; a comparison computing ``cond`` that only this reads is
    inlined.  Operands are aligned on the output's trailing axes (NumPy's broadcasting)."""
    edges = {edge.dst_conn: edge for edge in state.in_edges(node)}
    (out_edge,) = state.out_edges(node)
    shape = _dims_of(sdfg, out_edge.data.data)
    index = [f"__w{k}" for k in range(len(shape))]
    params = {p: dim == "1" for p, dim in zip(index, shape)}
    inputs: list[tuple[str, list[str]]] = []
    parts = []
    for conn in ("_mrg_mask", "_mrg_t", "_mrg_f"):
        array = edges[conn].data.data
        if array in constants:
            parts.append(f"({constants[array]})")
            continue
        readers = sum(1 for st in sdfg.states() for n in st.data_nodes() if n.data == array
                      for _ in st.out_edges(n))
        source = next((r for r in raws if r.output[0] == array and r.kind == "map"), None)
        if conn == "_mrg_mask" and source is not None and readers == 1 \
                and isinstance(ast.parse(source.expr, mode="eval").body, ast.Compare):
            raws.remove(source)
            own = source.output[1]
            rename = dict(zip(own, index[len(index) - len(own):]))
            names = {f"in{k}": f"in{len(inputs) + k}" for k in range(len(source.inputs))}
            parts.append(_map_expression(f"__out = {source.expr}", names))
            inputs += [(name, [rename.get(i, i) for i in idx]) for name, idx in source.inputs]
            continue
        rank = len(_dims_of(sdfg, array))
        parts.append(f"in{len(inputs)}")
        inputs.append((array, index[len(index) - rank:]))
    return _RawPrimitive("map", f"where({parts[0]}, {parts[1]}, {parts[2]})", inputs,
                         (out_edge.data.data, index), params)


def _origin(spec: LayerSpec, sdfg, array: str) -> str:
    """Where the spec computes ``array``: ``file:line: the line``, from DaCe's debug information."""
    for state in sdfg.states():
        for node in state.data_nodes():
            if node.data != array:
                continue
            for edge in state.in_edges(node):
                info = getattr(edge.src, "debuginfo", None)
                if info is None or not info.start_line:
                    continue
                path, line = spec_line(info.filename, info.start_line) or (info.filename, info.start_line)
                if str(path) != str(spec.path):  # a line of DaCe's own source: not the user's to read
                    continue
                text = linecache.getline(str(path), line).strip()
                return f"{path}:{line}: {text}" if text else f"{path}:{line}"
    return str(spec.path)


def _returned_einsums(sdfg, records: list[EinsumRecord]) -> list[EinsumRecord]:
    """Simplification renames an einsum returned directly to ``__return``: point its record there."""
    missing = [r for r in records if r.output not in sdfg.arrays]
    if not missing:
        return records
    written_by_library = []
    for state in sdfg.states():
        for node in state.data_nodes():
            if node.data.startswith("__return") and node.data not in written_by_library and any(
                    isinstance(e.src, nodes.LibraryNode) or (isinstance(e.src, nodes.AccessNode) and _is_view(sdfg, e.src.data))
                    or (isinstance(e.src, nodes.MapExit) and e.src.map.label.startswith("einsum"))  # a loop-nest einsum
                    for e in state.in_edges(node)):
                written_by_library.append(node.data)
    if len(missing) != len(written_by_library):
        raise SpecError("cannot find the result of einsum " + ", ".join(r.subscripts for r in missing)
                        + ": assign it to a name before returning it")
    renamed = dict(zip((r.output for r in missing), written_by_library))
    return [replace(r, output=renamed.get(r.output, r.output)) for r in records]


def _dims_of(sdfg, name: str) -> list[str]:
    return [str(s) for s in sdfg.arrays[name].shape]


def walk_sdfg(spec: LayerSpec, sdfg: dace.SDFG, records: list[EinsumRecord]) -> PrimitiveGraph:
    """Read the SDFG of ``spec`` into a ``PrimitiveGraph`` with letters on every dim."""
    records = _returned_einsums(sdfg, records)
    by_output = {record.output: record for record in records}
    raws: list[_RawPrimitive] = []
    constants: dict[str, str] = {}
    aliases: dict[str, str] = {}
    for state in sdfg.states():
        _read_state(sdfg, state, by_output, raws, constants, aliases)
    if aliases:
        raise SpecError(f"{_origin(spec, sdfg, next(iter(aliases)))}: a copy of an array is not supported: "
                        "use the array itself")

    out_arrays = sorted(name for name in sdfg.arrays if name.startswith("__return"))
    rename = dict(zip(out_arrays, spec.output_names))
    for name in spec.output_names:  # h = x @ w; h = f(h); return h: the first h, an array of its own, is renamed
        if name in sdfg.arrays:
            rename[name] = next(n for k in range(1, len(sdfg.arrays) + 2)
                                if (n := f"{name}_{k}") not in sdfg.arrays and n not in spec.output_names)
    letters: dict[str, str] = {arg.name: arg.letters for arg in spec.arguments}
    letter_dims = dict(spec.letter_dims)
    tensors = {arg.name: TensorInfo(arg.name, arg.letters,
                                    "dropout" if arg.kind == "dropout" else ("input" if arg.requires_grad else "constant"),
                                    arg.p, getattr(arg, "value", ""))
               for arg in spec.arguments}

    def bind(letter: str, dim: str, where: str) -> None:
        known = letter_dims.setdefault(letter, dim)
        if known != dim:
            raise SpecError(f"{spec.path}: contradictory dims: letter {letter} is {known} but {where} uses it for "
                            f"a dim of size {dim}")

    primitives: list[Primitive] = []
    relabelled: dict[str, tuple[str, tuple[int, ...]]] = {}  # array -> (source, source axis -> array axis)
    pending = list(raws)
    while pending:  # topological: a primitive is ready when all its inputs have letters
        ready = [raw for raw in pending if all(name in letters for name, _ in raw.inputs)]
        if not ready:
            missing = sorted({name for raw in pending for name, _ in raw.inputs if name not in letters})
            raise SpecError(f"{_origin(spec, sdfg, missing[0])}: DaCe turned this into a construct datamove cannot "
                            "read; write it with " + SUPPORTED)
        raw = ready[0]
        pending.remove(raw)
        out_name = rename.get(raw.output[0], raw.output[0])
        if raw.kind == "einsum":
            ins, out = raw.expr.split("->")
            terms = ins.split(",")
            if len(terms) != len(raw.inputs):
                raise SpecError(f"{spec.path}: einsum {raw.expr!r} has {len(terms)} terms for {len(raw.inputs)} operands")
            for term, (name, _) in zip(terms, raw.inputs):
                for letter, dim in zip(term, _dims_of(sdfg, name)):
                    bind(letter, dim, f"einsum {raw.expr!r} on {name}")
            if len(terms) == 1 and sorted(terms[0]) == sorted(out) and len(set(out)) == len(out):
                if out_name in spec.output_names:
                    raise SpecError(f"{spec.path}: the output {out_name} is a transposed view: compute it in the "
                                    "order of its axes")
                (name, _), = raw.inputs  # a relabelling: its readers read the operand, permuted
                source, positions = relabelled.get(name, (name, tuple(range(len(terms[0])))))
                relabelled[raw.output[0]] = (source, tuple(out.index(terms[0][p]) for p in positions))
                letters[raw.output[0]] = out
                continue
            inputs = tuple(Operand(name, term) for term, (name, _) in zip(terms, raw.inputs))
            output = Operand(out_name, out)
        elif raw.kind == "reduce":
            (name, axes), = raw.inputs
            axes = {int(a) for a in axes}
            src_letters = _axis_letters(sdfg, name, letters[name])
            out_letters = "".join(l for n, l in enumerate(src_letters) if n not in axes and l != "1")
            inputs = (Operand(name, letters[name]),)
            output = Operand(out_name, out_letters)
        else:
            param_letter: dict[str, str] = {}
            inputs_list = []
            for name, index in raw.inputs:
                axis_letters = _axis_letters(sdfg, name, letters[name])
                op_letters = ""
                for letter, idx in zip(axis_letters, index):
                    if letter == "1":
                        continue
                    if idx not in raw.params:
                        raise SpecError(f"{spec.path}: unsupported indexing {name}[{', '.join(index)}] "
                                        "(slices and offsets are not supported; broadcast with None)")
                    param_letter.setdefault(idx, letter)
                    op_letters += param_letter[idx]
                inputs_list.append(Operand(name, op_letters))
            out_index = raw.output[1]
            unnamed = [p for p in out_index if not raw.params.get(p, True) and p not in param_letter]
            if unnamed:
                raise SpecError(f"{spec.path}: cannot name a dim of {out_name}: it does not come from any input")
            out_letters = "".join(param_letter[p] for p in out_index if p in param_letter)
            inputs = tuple(inputs_list)
            output = Operand(out_name, out_letters)
        for letter, dim in zip(output.letters, [d for d in _dims_of(sdfg, raw.output[0]) if d != "1"]):
            bind(letter, dim, f"the result {out_name}")
        letters[raw.output[0]] = output.letters
        letters[out_name] = output.letters
        role = "output" if out_name in spec.output_names else "intermediate"
        tensors[out_name] = TensorInfo(out_name, output.letters, role)
        inputs = tuple(_unrelabelled(op, relabelled) for op in inputs)
        inputs = tuple(Operand(rename.get(op.tensor, op.tensor), op.letters) for op in inputs)
        primitives.append(Primitive(f"{raw.kind}:{out_name}", raw.kind, inputs, output, raw.expr))

    primitives, tensors = _tidy_names(primitives, tensors, spec.module_prefix)
    unknown_dims = sorted({d for d in letter_dims.values() if d not in spec.dim_values})
    if unknown_dims:
        raise SpecError(f"{spec.path}: sizes {', '.join(unknown_dims)} are not declared dims")
    return PrimitiveGraph(tensors, primitives, letter_dims, dict(spec.dim_values), list(spec.output_names))


def _unrelabelled(operand: Operand, relabelled: dict[str, tuple[str, tuple[int, ...]]]) -> Operand:
    """An operand reading a relabelled (transposed) array reads its source with permuted letters."""
    if operand.tensor not in relabelled:
        return operand
    source, positions = relabelled[operand.tensor]
    return Operand(source, "".join(operand.letters[p] for p in positions))


def _axis_letters(sdfg, array: str, letters: str) -> str:
    """Letters per array axis, "1" for unit (broadcast) axes the tensor's letters skip."""
    dims = _dims_of(sdfg, array) if array in sdfg.arrays else ["?"] * len(letters)
    result, pos = "", 0
    for dim in dims:
        if dim == "1" and (pos >= len(letters) or len(dims) > len(letters)):
            result += "1"
        else:
            result += letters[pos]
            pos += 1
    return result


def _tidy_names(primitives: list[Primitive], tensors: dict[str, TensorInfo], prefix: str):
    """Readable tensor names: drop DaCe's module prefix of inlined helpers; einsum results get
    their operands' names (``einsum_phi_ibj__p_wq_x`` -> ``wq_x``)."""
    new: dict[str, str] = {}
    taken = set(tensors) - {prim.output.tensor for prim in primitives}
    for prim in primitives:
        old = prim.output.tensor
        name = old.removeprefix(prefix + "_")
        if prim.kind == "einsum" and name.startswith("einsum_"):
            name = "_".join(new.get(op.tensor, op.tensor) for op in prim.inputs)
        base, n = name, 1
        while name in taken:
            name, n = f"{base}_{n}", n + 1
        taken.add(name)
        new[old] = name

    def rename(operand: Operand) -> Operand:
        return Operand(new.get(operand.tensor, operand.tensor), operand.letters)

    primitives = [Primitive(f"{p.kind}:{new[p.output.tensor]}", p.kind, tuple(map(rename, p.inputs)),
                            rename(p.output), p.expr) for p in primitives]
    tensors = {new.get(name, name): replace(info, name=new.get(name, name)) for name, info in tensors.items()}
    return primitives, tensors
