"""One Triton code generator for every fused element-wise / normalization operator.

Input: an operator (any group of "map" / "reduce" primitives of a ``PrimitiveGraph``, forward or
backward, fused or not) and a ``layouts.space.Configuration``.  Output: readable Triton source
(``generate_source``), written to a cache directory keyed by its hash, imported with importlib
and compiled by Triton (``compile_operator``).  Graphs are ``dataflow.graph`` objects (plain
Python, no DaCe), live or loaded from the snapshots of ``dataflow.snapshot``.

The generated kernel, over the operator's letters (``layouts.space.operator_letters``):
- program ids over the independent letters, flattened (plus blocks of the column axis for an
  element-wise operator); a 2-D tile [BLOCK_ROW, BLOCK_COL] whose axes flatten the letters of
  ``layouts.space.tile_axes`` (the vector letter innermost on the column axis);
- every tensor addressed as ``sum(idx_<letter> * stride_<tensor>_<letter>)`` with one stride
  argument per letter per tensor (any layout), masks for ragged edges;
- normalizations: mode "row" keeps whole reduction rows in the tile and runs the expression DAG
  once; mode "loop" makes one pass over chunks of the reduction per level of chained reductions
  (layernorm: mean, then variance, then the outputs; softmax: max, then sum, then outputs),
  statistics between passes, each output stored in the first pass that can compute it (a bias
  gradient's element-wise outputs in the pass that sums it); mode "split" (reductions along the
  tile's rows whose results nothing else reads) is "loop" over one of ``split`` slices of the
  rows: each program writes its fp32 partial sums to a scratch buffer, and the last program of a
  column block to arrive (an int32 counter per column block, reset by that program) adds them in
  slice order and stores the result, so the sum is the same whatever order programs finish in;
  an operator with column sums (``layouts.space.column_sums``: a layernorm backward joined with its
  parameter gradients) runs mode "row" on ``programs`` programs, each visiting every
  ``programs``-th block of rows and adding each block's rows into one row of sums (knob
  ``sums_kept`` "tile": into a tile of sums whose rows it adds after the loop), which it stores;
  ``<op>_sums_kernel``, launched after it, adds the programs' rows in program order and stores them;
- fp32 arithmetic and statistics whatever the storage dtype, stores cast to each output's dtype;
- dropout: a multiplication by a tensor of role "dropout" is not loaded but regenerated from the
  counter ``offset_<mask> + n`` (``n`` the element's row-major index over the mask's letters in
  spec order, ``dataflow.dropout_mask``), scaled by ``dropout_scale(p)``.  When the tile's column letters are
  the mask's trailing letters in spec order (consecutive columns = consecutive n), their extent is
  a multiple of 64 and BLOCK_COL too, the mask takes one Philox call per sixteen columns
  (``kernels.philox.keep_bits`` on a [rows, BLOCK_COL // 16] block of call counters, spread over the
  columns by ``unpack_gathered`` where a thread holds ``GATHER_ELEMENTS`` or more, else
  ``dropout_keep_grouped``, each thread drawing the calls it uses; whole
  groups of 64 counters; this needs ``offset_<mask> % 64 == 0``, which ``dataflow.executor.dropout_offsets`` guarantees and
  ``CompiledOperator.run`` checks); the same along the tile's rows when its row letters are the
  mask's trailing letters (one call per sixteen rows, on the transposed block of calls); where a
  reduction runs along the columns of such a tile (layernorms over i of BERT's ibj masks) and
  BLOCK_ROW is 2, 4, 8 or 16, the program takes rows of one Philox call per column
  (``_row_call_masks``): one call per BLOCK_ROW elements; otherwise one call per element (``kernels.philox.dropout_keep(seed, offset, n, threshold)``).
  Knob ``dropout="load"`` reads a stored mask (values 0 or ``dropout_scale(p)``) instead;
- sizes as runtime int arguments ``size_<letter>``, dim names used in expressions (``N``,
  ``sqrt(P)``) and dropout keep factors ``scale_<mask>`` (``PrimitiveGraph.scalars``: 1 in a graph
  whose probabilities are 0) as float arguments ``dim_<name>``.
"""
from __future__ import annotations

import ast
import functools
import hashlib
import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path

import torch
import triton

from datamove.dataflow.dropout_mask import DECISION_GROUP
from datamove.kernels.interpreter import interpreted
from datamove.kernels.launch import DirectLaunch
from datamove.kernels.philox import dropout_scale, keep_threshold
from datamove.layouts.space import (ROW_CALL_BLOCKS, Configuration, OperatorLetters, grouped_masks, operator_letters, parts, terminal_reductions,
                           tile_axes)

# Bumped whenever a configuration's generated kernel changes in what it does (the tuning DB keys
# generated operators' timings by it, ``harness.sweep_variants.op_signature``).  2: blocks of 2, 4 and 8
# rows take rows of one Philox call per column (were one call per element).  3: a mask grouped along
# the tile's columns is drawn once per call and its bits exchanged (``kernels.philox.unpack_gathered``).
# 4: column sums over a row-call mask loop over whole calls, drawing each column's call once for all
# its blocks of rows (was once a block).
GENERATOR_VERSION = 4
# Elements per thread from which a mask grouped along the tile's columns exchanges its bits by
# ``tl.gather``: with fewer, Triton 3.6 may fail to compile the exchange (its thread-locality pass;
# cross-compiled for sm_90: BERT-large's bias + ReLU + dropout over ubj at 8 or 4 elements a thread,
# GPT-2's softmax + dropout over rows of 1024 at 16).
GATHER_ELEMENTS = 32
# The kernel adding up each program's column sums (``layouts.space.column_sums``; ``_part_code``'s
# ``sums_kernel``): columns per program, programs' sums per load (all of them, for up to 256 programs:
# one load per sum).  (Atomic adds of each program's sums into one row were wrong on an H100 with
# Triton 3.6 in most configurations; a last program to arrive adding everyone's sums left a serial
# tail: BERT-large's layernorm backward with its parameter gradients and the output bias gradient
# 31.4 us, against 18.7 for the layernorm backward alone; 32 columns and 64 programs a load: 9.9 us.)
SUM_COLUMNS, SUM_ROWS = 16, 256
CACHE_DIR = Path(os.environ.get("DATAMOVE_KERNEL_CACHE", Path.home() / ".cache" / "datamove" / "kernels"))
_FUNCTIONS = {"exp": "tl.exp", "log": "tl.log", "sqrt": "tl.sqrt_rn", "maximum": "tl.maximum",
              "minimum": "tl.minimum", "abs": "tl.abs", "where": "tl.where", "tanh": "_tanh"}
_modules: dict[str, object] = {}


@dataclass(frozen=True)
class _Plan:
    """What the source generator decided (also used by the launcher)."""

    letters: OperatorLetters
    grid: str  # letters with one index per program
    rows: str  # letters flattened on the tile's row axis
    cols: str  # letters flattened on the tile's column axis
    reduce_axis: int | None  # 1: reduce along columns, 0: along rows, None: element-wise
    loads: tuple  # external tensors read from memory
    regenerated: tuple  # dropout masks regenerated from (seed, offset)
    outputs: tuple
    dim_names: tuple  # dim names and dropout scales used in expressions -> dim_<name> float args
    grouped: tuple  # the regenerated masks drawn one Philox call per sixteen columns (``layouts.space.grouped_masks``)
    row_grouped: tuple  # ... per sixteen rows (the same rule along the tile's rows)
    row_calls: tuple  # ... per column for BLOCK_ROW rows of one call, 64 G + 2 t + 8 i + e (``_row_call_masks``)
    split: int  # row slices of mode "split" (1: none)
    reduced_outputs: tuple  # tensors the reduce primitives produce, in primitive order
    summed: tuple = ()  # the column sums' outputs (``layouts.space.column_sums``), in primitive order


def _row_call_masks(graph, letters: OperatorLetters, rows: str, regenerated: tuple, block_row: int) -> tuple:
    """The masks of ``regenerated`` whose decisions can come from one Philox call per column for all
    ``block_row`` rows of a tile reduced along its columns: the row letters are the mask's trailing
    letters in spec order, their extent a multiple of 64, ``block_row`` one of ``ROW_CALL_BLOCKS``,
    and the program takes rows 64 G + 2 t + 8 i + e (e < 2) of call 4 G + t for ``block_row // 2``
    consecutive i (the program-id decomposition in ``generate_source``) instead of consecutive
    rows: ``block_row`` of the call's sixteen bytes (16 rows: all of them).  A row-reduction tile
    of one row per program draws one call per element; two rows already draw half as many."""
    if block_row not in ROW_CALL_BLOCKS:
        return ()
    return grouped_masks(graph, letters, rows, regenerated, DECISION_GROUP)


def _plan(graph, op, knobs: dict) -> _Plan:
    letters = operator_letters(graph, op)
    reduces = [p for p in op.primitives if p.kind == "reduce"]
    summed = []
    for prim in reduces:
        mine = "".join(letters.prim_letters[prim.name][l] for l in prim.reduced)
        if letters.summed and set(mine) == set(letters.summed):
            summed.append(prim.output.tensor)
        elif set(mine) != set(letters.reduced):
            raise NotImplementedError(f"{op.name}: reductions over different letter sets ({mine} vs "
                                      f"{letters.reduced}) in one kernel")
    if summed and (knobs["mode"] != "row" or knobs["vector"] not in letters.reduced):
        raise ValueError(f"{op.name}: column sums over {letters.summed} need mode 'row' with the vector letter "
                         f"reduced ({letters.reduced}), not mode {knobs['mode']!r} along {knobs['vector']!r}")
    if sorted(knobs["order"]) != sorted(letters.letters) or knobs["order"][-1] != knobs["vector"]:
        raise ValueError(f"{op.name}: knob order {knobs['order']!r} must hold letters {letters.letters!r}, "
                         f"vector {knobs['vector']!r} last")
    grid, rows, cols = tile_axes(letters, knobs)
    reduce_axis = None if not letters.reduced else (1 if knobs["vector"] in letters.reduced else 0)
    split = knobs.get("split", 1) if knobs["mode"] == "split" else 1
    if knobs["mode"] == "split" and (reduce_axis != 0 or not terminal_reductions(op)):
        raise ValueError(f"{op.name}: mode 'split' needs a reduction along the tile's rows (vector letter "
                         f"not reduced) whose results no primitive of the operator reads")
    regenerate = knobs.get("dropout", "regenerate") == "regenerate"
    regenerated = tuple(t for t in op.inputs if graph.tensors[t].role == "dropout" and regenerate)
    loads = tuple(t for t in op.inputs if t not in regenerated)
    dim_names, scalars = set(), graph.scalars()
    for prim in op.primitives:
        if prim.kind == "map":
            for node in ast.walk(ast.parse(prim.expr, mode="eval")):
                if isinstance(node, ast.Name) and node.id in scalars:
                    dim_names.add(node.id)
    grouped = grouped_masks(graph, letters, cols, regenerated, knobs["block_col"])
    row_grouped = tuple(t for t in grouped_masks(graph, letters, rows, regenerated, knobs["block_row"]) if t not in grouped)
    row_calls = () if reduce_axis != 1 else tuple(
        t for t in _row_call_masks(graph, letters, rows, regenerated, knobs["block_row"]) if t not in grouped + row_grouped)
    return _Plan(letters, grid, rows, cols, reduce_axis, loads, regenerated, tuple(op.outputs), tuple(sorted(dim_names)),
                 grouped, row_grouped, row_calls, split, tuple(p.output.tensor for p in reduces), tuple(summed))


class _Expr(ast.NodeTransformer):
    """Map expression -> Triton expression: inK -> value variables, dims and scales -> dim_<name> args."""

    def __init__(self, operands: list[str], dims):
        self.operands, self.dims = operands, dims

    def visit_Name(self, node):
        if node.id.startswith("in") and node.id[2:].isdigit():
            return ast.Name(self.operands[int(node.id[2:])], ast.Load())
        if node.id in self.dims:
            return ast.Name(f"dim_{node.id}", ast.Load())
        raise ValueError(f"unknown name {node.id!r} in a map expression")

    def visit_Constant(self, node):
        return ast.Constant(float(node.value)) if isinstance(node.value, (int, float)) else node

    def visit_Call(self, node):
        node.args = [self.visit(arg) for arg in node.args]
        if not (isinstance(node.func, ast.Name) and node.func.id in _FUNCTIONS):
            raise ValueError(f"unsupported function in a map expression: {ast.unparse(node.func)}")
        node.func = ast.parse(_FUNCTIONS[node.func.id], mode="eval").body
        return node

    def visit_BinOp(self, node):
        self.generic_visit(node)
        if isinstance(node.op, ast.Pow):  # small integer powers (derivatives: tanh' = 1 - tanh**2) as products
            power = node.right.value if isinstance(node.right, ast.Constant) else None
            if not (isinstance(power, float) and power.is_integer() and 1 <= power <= 4):
                raise ValueError(f"'**' only with a constant integer exponent 1..4, not {ast.unparse(node.right)}")
            product = node.left
            for _ in range(int(power) - 1):
                product = ast.BinOp(product, ast.Mult(), node.left)
            return product
        return node


class _Writer:
    def __init__(self):
        self.lines: list[str] = []

    def __call__(self, line: str = "", depth: int = 1):
        self.lines.append("    " * depth + line if line else "")


def _var(tensor: str) -> str:
    return f"v_{tensor}"


def _part_code(graph, op, knobs: dict, index64: bool) -> tuple[list, list[str], str, tuple | None]:
    """The code of one connected part: (signature [(parameter names, comment)], body lines at
    depth 1 starting from the program id ``pid``, a description for the docstring, and for column
    sums the (signature, body) of the kernel that adds up each program's sums)."""
    plan = _plan(graph, op, knobs)
    L = plan.letters
    axes = L.tensor_axes
    producer = {p.output.tensor: p for p in op.primitives}
    externals = list(plan.loads) + [t for t in plan.outputs]

    # --- signature ------------------------------------------------------------------------
    sig = []
    for t in plan.loads:
        sig.append(([f"{t}_ptr"], f"{axes[t]} (spec order {graph.tensors[t].letters}), any strides: input"))
    for t in plan.outputs:
        sig.append(([f"{t}_ptr"], f"{axes[t]} (spec order {graph.tensors[t].letters}), any strides: output"))
    for t in externals:
        if axes[t]:
            sig.append(([f"stride_{t}_{l}" for l in axes[t]], ""))
    sig.append(([f"size_{l}" for l in L.letters], "extents of " + ", ".join(f"{l}={L.dims[l]}" for l in L.letters)))
    if plan.dim_names:
        sig.append(([f"dim_{d}" for d in plan.dim_names], "dim values and dropout scales as floats"))
    for t in plan.regenerated:
        sig.append(([f"seed_{t}", f"offset_{t}"], f"Philox key and counter offset of dropout mask {t}"))
    if plan.split > 1:
        sig.append((["split_partials_ptr"], f"float32 [{len(plan.reduced_outputs)}, BLOCK_SPLIT, column blocks, "
                                            "BLOCK_COL], contiguous: each slice's partial sums"))
        sig.append((["split_arrivals_ptr"], "int32 [column blocks], zero between launches: slices done"))
    if plan.summed:
        sig.append((["sums_ptr"], f"float32 [BLOCK_PROGRAMS, {len(plan.summed)}, BLOCK_COL]: each program's "
                                  "column sums (the sums kernel adds them up)"))
    sig.append((["BLOCK_ROW: tl.constexpr", "BLOCK_COL: tl.constexpr"] +
                (["BLOCK_SPLIT: tl.constexpr"] if plan.split > 1 else []) +
                (["BLOCK_PROGRAMS: tl.constexpr"] if plan.summed else []), ""))

    w = _Writer()
    def describe(prim) -> str:
        own = L.prim_letters[prim.name]
        names = {f"in{n}": f"{o.tensor}[{''.join(own[l] for l in o.letters)}]" for n, o in enumerate(prim.inputs)}
        out = f"{prim.output.tensor}[{''.join(own[l] for l in prim.output.letters)}]"
        if prim.kind == "reduce":
            return f"{out} = {prim.expr} over {''.join(own[l] for l in prim.reduced)} of {names['in0']}"
        tree = ast.parse(prim.expr, mode="eval")
        for node in ast.walk(tree):
            if isinstance(node, ast.Name) and node.id in names:
                node.id = names[node.id]
        return f"{out} = {ast.unparse(tree)}"

    prims_doc = "\n".join("    " + describe(p) for p in op.primitives)
    doc = f"""{prims_doc}

Letters: {", ".join(f"{l}={L.dims[l]}" for l in L.letters)}; reduced: {L.reduced or "-"}.
Grid letters: {plan.grid or "-"}; tile rows: {plan.rows or "-"}; tile columns: {plan.cols or "-"}.
Knobs: {knobs}"""

    # --- program ids and index decomposition ------------------------------------------------
    if index64:
        w("pid = pid.to(tl.int64)")

    def decompose(flat: str, group: str, shape: str, depth: int = 1):
        """idx_<l> for the letters of ``group`` flattened row-major in ``flat`` (shape suffix)."""
        rem = flat
        for pos, letter in enumerate(reversed(group)):
            if pos == len(group) - 1:
                w(f"idx_{letter} = {rem}{shape}", depth)
            else:
                w(f"idx_{letter} = ({rem} % size_{letter}){shape}", depth)
                w(f"{flat}_rest{pos} = {rem} // size_{letter}", depth)
                rem = f"{flat}_rest{pos}"

    def extent(group: str) -> str:
        return " * ".join(f"size_{l}" for l in group) if group else "1"

    row_block = "rb" if plan.summed else "pid"  # the index of the block of rows a program takes (reduced along columns)
    tile_sums = knobs.get("sums_kept", "row") == "tile"  # column sums kept in a tile, its rows summed after the loop
    # column sums over row-call masks: a program's loop visits whole calls (rows of call 4 G + t, the
    # 16 // BLOCK_ROW blocks of its bytes in turn), drawing each column's call once, not once a block
    call_loop = bool(plan.summed and plan.row_calls)

    def emit_row_block(depth: int):
        """rows (and, inside a loop over blocks of rows, row_ok and the row letters' indices) of block ``row_block``."""
        if call_loop:  # inside the loop over calls rc = 4 G + t, block rq of its bytes
            w("row_byte = rq * BLOCK_ROW  # the byte of the block's first row: 2 i + e", depth)
            w("row_start = row_group * 64 + 2 * (rc % 4) + 4 * row_byte", depth)
            w("rows = row_start + 8 * (tl.arange(0, BLOCK_ROW) // 2) + tl.arange(0, BLOCK_ROW) % 2", depth)
        elif plan.row_calls:  # rows 64 G + 2 t + 8 i + e of call 4 G + t (byte 2 i + e):
            # 64 // BLOCK_ROW blocks per G, t = block % 4, BLOCK_ROW // 2 values of i from (block // 4) % (16 // BLOCK_ROW)
            w(f"row_group = {row_block} // (64 // BLOCK_ROW)  # G", depth)
            w(f"row_byte = (({row_block} // 4) % (16 // BLOCK_ROW)) * BLOCK_ROW  # the byte of the block's first row: 2 i + e",
              depth)
            w(f"row_start = row_group * 64 + 2 * ({row_block} % 4) + 4 * row_byte", depth)
            w("rows = row_start + 8 * (tl.arange(0, BLOCK_ROW) // 2) + tl.arange(0, BLOCK_ROW) % 2", depth)
        else:
            w(f"row_start = {row_block} * BLOCK_ROW", depth)
            w("rows = row_start + tl.arange(0, BLOCK_ROW)", depth)
        if plan.summed:
            if index64:
                w("rows = rows.to(tl.int64)", depth)
            w("row_ok = (rows < n_rows)[:, None]", depth)
            decompose("rows", plan.rows, "[:, None]", depth)

    w(f"n_rows = {extent(plan.rows)}")
    w(f"n_cols = {extent(plan.cols)}")
    if plan.reduce_axis is None:
        w("col_blocks = tl.cdiv(n_cols, BLOCK_COL)")
        w("row_start = (pid // col_blocks) * BLOCK_ROW")
        w("rows = row_start + tl.arange(0, BLOCK_ROW)")
        w("col_start = (pid % col_blocks) * BLOCK_COL")
        w("cols = col_start + tl.arange(0, BLOCK_COL)")
    elif plan.reduce_axis == 1 and not plan.summed:
        emit_row_block(1)
    elif plan.reduce_axis == 0:
        if plan.split > 1:  # the BLOCK_SPLIT programs of a column block are neighbours
            w("row_slice = pid % BLOCK_SPLIT")
            w("pid = pid // BLOCK_SPLIT")
        w("col_blocks = tl.cdiv(n_cols, BLOCK_COL)")
        w("col_start = (pid % col_blocks) * BLOCK_COL")
        w("cols = col_start + tl.arange(0, BLOCK_COL)")
        w("g = pid // col_blocks")
        decompose("g", plan.grid, "")
    if index64:
        for axis in ("rows", "cols") if plan.reduce_axis is None else (("rows",) if plan.reduce_axis == 1 else ("cols",)):
            if not (axis == "rows" and plan.summed):
                w(f"{axis} = {axis}.to(tl.int64)")
    if plan.reduce_axis != 0 and not plan.summed:
        w("row_ok = (rows < n_rows)[:, None]")
        decompose("rows", plan.rows, "[:, None]")
    if plan.reduce_axis != 1:
        w("col_ok = (cols < n_cols)[None, :]")
        decompose("cols", plan.cols, "[None, :]")
    for t in plan.regenerated:  # logical row-major strides over the mask's spec-order letters
        spec_axes = axes[t]
        for pos, letter in enumerate(spec_axes):
            inner = spec_axes[pos + 1:]
            w(f"lstride_{t}_{letter} = {' * '.join(f'size_{l}' for l in inner) if inner else '1'}")

    reduced_axis_letters = plan.cols if plan.reduce_axis == 1 else plan.rows if plan.reduce_axis == 0 else ""

    def on_reduced_axis(tensor_letters: str) -> bool:
        return any(l in reduced_axis_letters for l in tensor_letters)

    def mask_of(tensor_letters: str) -> str | None:
        parts = [name for group, name in ((plan.rows, "row_ok"), (plan.cols, "col_ok"))
                 if any(l in group for l in tensor_letters)]
        return " & ".join(parts) or None

    def offset_of(t: str) -> str:
        return " + ".join(f"idx_{l} * stride_{t}_{l}" for l in axes[t]) or "0"

    # --- the expression DAG -------------------------------------------------------------------
    level: dict[str, int] = {t: 0 for t in op.inputs}  # chained-reduction depth
    for prim in op.primitives:
        deps = max(level[o.tensor] for o in prim.inputs)
        level[prim.output.tensor] = deps + 1 if prim.kind == "reduce" else deps
    n_pass = max((level[p.output.tensor] for p in op.primitives if p.kind == "reduce"), default=0)

    def row_call_bits(t: str) -> str:
        """uint16 [1, BLOCK_COL]: the keep decisions of call 4 G + t of each column of row-call mask ``t``."""
        base = "".join(f"idx_{l} * lstride_{t}_{l} + " for l in axes[t] if l not in plan.rows)
        calls = f"((offset_{t} + {base}row_group * 64) >> 4) + {'rc' if call_loop else row_block} % 4"
        return f"keep_bits(seed_{t}, {calls}, {keep_threshold(graph.tensors[t].p)})"

    def emit_input(t: str, depth: int):
        if t in plan.regenerated:
            info = graph.tensors[t]
            scale, threshold = dropout_scale(info.p), keep_threshold(info.p)
            if t in plan.grouped:  # column 64 G + 8 i + 2 t + e of the block: byte 2 i + e of call (col start) // 16 + 4 G + t
                base = "".join(f"idx_{l} * lstride_{t}_{l} + " for l in axes[t] if l not in plan.cols)
                calls = f"((offset_{t} + {base}col_start) >> 4) + tl.arange(0, BLOCK_COL // 16)[None, :]"
                if knobs["block_row"] * knobs["block_col"] >= GATHER_ELEMENTS * 32 * knobs["num_warps"]:
                    keep = f"unpack_gathered(keep_bits(seed_{t}, {calls}, {threshold}))"
                else:
                    keep = f"dropout_keep_grouped(seed_{t}, {calls}, {threshold})"
                note = "one Philox call per sixteen columns"
            elif t in plan.row_grouped:  # the same along rows, on the transposed block of calls
                base = "".join(f"idx_{l} * lstride_{t}_{l} + " for l in axes[t] if l not in plan.rows)
                calls = f"((offset_{t} + {base}row_start) >> 4) + tl.arange(0, BLOCK_ROW // 16)[:, None]"
                keep = f"tl.trans(dropout_keep_grouped(seed_{t}, tl.trans({calls}), {threshold}))"
                note = "one Philox call per sixteen rows"
            elif t in plan.row_calls and call_loop:  # drawn once per call, before its blocks
                keep = f"unpack_rows(bits_{t}, row_byte, BLOCK_ROW)"
                note = "the bytes of the block's rows in its column's call"
            elif t in plan.row_calls:  # row r of the block: byte (first byte) + r of the one call of its column
                keep = f"unpack_rows({row_call_bits(t)}, row_byte, BLOCK_ROW)"
                note = "one Philox call per column for the block's rows"
            else:
                index = " + ".join(f"idx_{l} * lstride_{t}_{l}" for l in axes[t])
                keep = f"dropout_keep(seed_{t}, offset_{t}, {index}, {threshold})"
                note = "one Philox call per element"
            w(f"{_var(t)} = tl.where({keep}, {scale!r}, 0.0)  # dropout mask {t}[{axes[t]}] regenerated, {note}", depth)
        else:
            mask = mask_of(axes[t])
            extra = f", mask={mask}, other=0.0" if mask else ""
            w(f"{_var(t)} = tl.load({t}_ptr + {offset_of(t)}{extra}).to(tl.float32)", depth)

    scalars = graph.scalars()  # the names a map expression may use besides its operands

    def emit_map(prim, depth: int):
        operands = [_var(o.tensor) for o in prim.inputs]
        expr = ast.unparse(_Expr(operands, scalars).visit(ast.parse(prim.expr, mode="eval")))
        w(f"{_var(prim.output.tensor)} = {expr}", depth)

    def emit_store(t: str, depth: int):
        mask = mask_of(axes[t])
        extra = f", mask={mask}" if mask else ""
        value = f"store_cast({_var(t)}, {t}_ptr)" if interpreted() else f"{_var(t)}.to({t}_ptr.dtype.element_ty)"
        w(f"tl.store({t}_ptr + {offset_of(t)}, {value}{extra})", depth)

    def needed(targets: list[str], available: set) -> list:
        """Primitives (in order) computing ``targets`` from the ``available`` values and inputs."""
        want, stack = set(), list(targets)
        while stack:
            t = stack.pop()
            if t in want or t in available or t not in producer:
                continue
            want.add(t)
            stack.extend(o.tensor for o in producer[t].inputs)
        return [p for p in op.primitives if p.output.tensor in want]

    def emit_sums_partials():
        """Each program's column sums into its row of ``sums`` (plain stores: a value its threads hold
        twice is stored twice, never added twice); ``<op>_sums_kernel`` adds the rows up."""
        for r, t in enumerate(plan.summed):
            acc = f"tl.sum(acc_{t}, axis=0)[None, :]" if tile_sums else f"acc_{t}"
            w(f"tl.store(sums_ptr + (pid * {len(plan.summed)} + {r}) * BLOCK_COL + cols[None, :], {acc}, mask=col_ok)")

    def sums_kernel() -> tuple[list, list[str]]:
        """(signature, body) of the kernel adding the programs' column sums and storing them: one
        program per ``SUM_COLUMNS`` columns, ``SUM_ROWS`` programs' sums per load."""
        n = len(plan.summed)
        fsig = [(["sums_ptr"], f"float32 [programs, {n}, BLOCK_COL]: each program's column sums")]
        fsig += [([f"{t}_ptr"], f"{axes[t]} (spec order {graph.tensors[t].letters}), any strides: output")
                 for t in plan.summed]
        fsig += [([f"stride_{t}_{l}" for l in axes[t]], "") for t in plan.summed if axes[t]]
        fsig += [([f"size_{l}" for l in plan.cols], ""), (["programs"], "programs of the main kernel"),
                 (["BLOCK_COL: tl.constexpr", "SUM_ROWS: tl.constexpr", "SUM_COLUMNS: tl.constexpr"], "")]
        main_lines, w.lines = w.lines, []
        w("pid = tl.program_id(0)")
        w(f"n_cols = {extent(plan.cols)}")
        w("cols = pid * SUM_COLUMNS + tl.arange(0, SUM_COLUMNS)")
        w("col_ok = (cols < n_cols)[None, :]")
        decompose("cols", plan.cols, "[None, :]")
        for t in plan.summed:
            w(f"{_var(t)} = tl.zeros([1, SUM_COLUMNS], tl.float32)")
        w("for start in range(0, programs, SUM_ROWS):  # program order")
        w("rows = (start + tl.arange(0, SUM_ROWS))[:, None]", 2)
        for r, t in enumerate(plan.summed):
            w(f"{_var(t)} += tl.sum(tl.load(sums_ptr + (rows * {n} + {r}) * BLOCK_COL + cols[None, :], "
              "mask=(rows < programs) & col_ok, other=0.0), axis=0)[None, :]", 2)
        for t in plan.summed:
            emit_store(t, 1)
        finish, w.lines = w.lines, main_lines
        return fsig, finish

    if plan.reduce_axis is None or knobs["mode"] == "row":
        depth = 1
        if plan.reduce_axis == 1:
            w("col_start = 0")
            w("cols = tl.arange(0, BLOCK_COL)")
            w("col_ok = (cols < n_cols)[None, :]")
            decompose("cols", plan.cols, "[None, :]")
        elif plan.reduce_axis == 0:
            w("row_start = 0")
            w("rows = tl.arange(0, BLOCK_ROW)")
            w("row_ok = (rows < n_rows)[:, None]")
            decompose("rows", plan.rows, "[:, None]")
        inputs = list(op.inputs)
        if plan.summed:  # column sums: a loop over every BLOCK_PROGRAMS-th block of rows, from the program's own
            inputs = [t for t in op.inputs if any(l in plan.rows for l in axes[t])]
            for t in op.inputs:  # read once: what has no row letter (a layernorm's gamma)
                if t not in inputs:
                    emit_input(t, 1)
            for t in plan.summed:  # each block's rows added into a row of registers (or a tile: sums_kept)
                w(f"acc_{t} = tl.zeros([{'BLOCK_ROW' if tile_sums else '1'}, BLOCK_COL], tl.float32)")
            if call_loop:
                w("for rc in range(pid, tl.cdiv(n_rows, 64) * 4, BLOCK_PROGRAMS):  # rows of call 4 G + t of every column")
                w("row_group = rc // 4  # G", 2)
                for t in plan.row_calls:
                    w(f"bits_{t} = {row_call_bits(t)}", 2)
                w("for rq in range(16 // BLOCK_ROW):", 2)
                depth = 3
            else:
                w(f"for {row_block} in range(pid, tl.cdiv(n_rows, BLOCK_ROW), BLOCK_PROGRAMS):")
                depth = 2
            emit_row_block(depth)
        for t in inputs:
            emit_input(t, depth)
        for prim in op.primitives:
            if prim.kind == "map":
                emit_map(prim, depth)
            elif prim.output.tensor in plan.summed:
                rows = f"tl.where(row_ok & col_ok, {_var(prim.inputs[0].tensor)}, 0.0)"
                w(f"acc_{prim.output.tensor} += {rows if tile_sums else f'tl.sum({rows}, axis=0)[None, :]'}", depth)
            else:
                neutral = "0.0" if prim.expr == "sum" else 'float("-inf")'
                fn = "tl.sum" if prim.expr == "sum" else "tl.max"
                keep = "[:, None]" if plan.reduce_axis == 1 else "[None, :]"
                w(f"{_var(prim.output.tensor)} = {fn}(tl.where(row_ok & col_ok, {_var(prim.inputs[0].tensor)}, {neutral}), "
                  f"axis={plan.reduce_axis}){keep}", depth)
        for t in plan.outputs:
            if t not in plan.summed:
                emit_store(t, depth)
        if plan.summed:
            emit_sums_partials()
    else:  # loop: one pass per reduction level, then the outputs
        if plan.reduce_axis == 1:
            idx_axis, ok, shape, n, block = "cols", "col_ok", "[None, :]", "n_cols", "BLOCK_COL"
        else:
            idx_axis, ok, shape, n, block = "rows", "row_ok", "[:, None]", "n_rows", "BLOCK_ROW"
        keep = "[:, None]" if plan.reduce_axis == 1 else "[None, :]"
        done: set[str] = set()
        for t in op.inputs:  # inputs without reduced letters: once, before the passes
            if not on_reduced_axis(axes[t]):
                emit_input(t, 1)
                done.add(t)

        def emit_statistics():
            progress = True
            while progress:
                progress = False
                for prim in op.primitives:
                    t = prim.output.tensor
                    if (prim.kind == "map" and t not in done and not on_reduced_axis(axes[t])
                            and all(o.tensor in done for o in prim.inputs)):
                        emit_map(prim, 1)
                        done.add(t)
                        progress = True
            for t in plan.outputs:
                if t in done and t not in stored:
                    emit_store(t, 1)
                    stored.add(t)

        def emit_split_finish():
            """Partial sums out; the column block's last slice to arrive adds them and stores the outputs."""
            w("col_blocks_all = col_blocks" + "".join(f" * size_{l}" for l in plan.grid), 1)
            w("partials = split_partials_ptr + pid * BLOCK_COL + tl.arange(0, BLOCK_COL)[None, :]", 1)
            for r, t in enumerate(plan.reduced_outputs):
                w(f"tl.store(partials + ({r} * BLOCK_SPLIT + row_slice) * col_blocks_all * BLOCK_COL, {_var(t)})", 1)
            w("tl.debug_barrier()  # every thread's partial sums precede the release below", 1)
            w("arrived = tl.atomic_add(split_arrivals_ptr + pid, 1, sem=\"acq_rel\")", 1)
            w("if arrived == BLOCK_SPLIT - 1:", 1)
            for r, t in enumerate(plan.reduced_outputs):
                w(f"{_var(t)} = tl.zeros([1, BLOCK_COL], tl.float32)", 2)
                w("for s in range(BLOCK_SPLIT):  # slice order: the same sum whichever slice finishes last", 2)
                w(f"{_var(t)} += tl.load(partials + ({r} * BLOCK_SPLIT + s) * col_blocks_all * BLOCK_COL, "
                  "cache_modifier=\".cg\")", 3)
                emit_store(t, 2)
                stored.add(t)
            w("tl.store(split_arrivals_ptr + pid, 0)  # ready for the next launch", 2)

        stored: set[str] = set()
        emit_statistics()
        if plan.split > 1:
            w("slice_rows = tl.cdiv(tl.cdiv(n_rows, BLOCK_SPLIT), BLOCK_ROW) * BLOCK_ROW", 1)
            w("slice_start = row_slice * slice_rows", 1)
        first, end = ("slice_start", "tl.minimum(slice_start + slice_rows, n_rows)") if plan.split > 1 else ("0", n)
        for pass_no in range(n_pass + 1):
            reduces = [p for p in op.primitives if p.kind == "reduce" and level[p.output.tensor] == pass_no + 1]
            outputs = [t for t in plan.outputs if t not in done and t not in stored and level[t] == pass_no]
            targets = [p.inputs[0].tensor for p in reduces] + outputs
            if not targets:
                continue
            w(f"# pass {pass_no + 1}: " + ", ".join(
                [f"{p.expr} -> {p.output.tensor}" for p in reduces] + ([f"store {', '.join(outputs)}"] if outputs else [])), 1)
            for prim in reduces:
                init = "tl.zeros" if prim.expr == "sum" else "tl.full"
                extra = "" if prim.expr == "sum" else ', float("-inf")'
                w(f"acc_{prim.output.tensor} = {init}([BLOCK_ROW, BLOCK_COL]{extra}, tl.float32)", 1)
            w(f"for start in range({first}, {end}, {block}):", 1)
            w(f"{'col' if plan.reduce_axis == 1 else 'row'}_start = start", 2)
            w(f"{idx_axis} = start + tl.arange(0, {block})", 2)
            w(f"{ok} = ({idx_axis} < {n}){shape}", 2)
            decompose(idx_axis, plan.cols if plan.reduce_axis == 1 else plan.rows, shape, 2)
            local = set(done)
            for prim in needed(targets, done):
                for o in prim.inputs:
                    if o.tensor not in local and o.tensor not in producer:
                        emit_input(o.tensor, 2)
                        local.add(o.tensor)
                if prim.output.tensor not in local:
                    emit_map(prim, 2)
                    local.add(prim.output.tensor)
            for t in targets:
                if t not in local and t in op.inputs:
                    emit_input(t, 2)
            for prim in reduces:
                val = _var(prim.inputs[0].tensor)
                acc = f"acc_{prim.output.tensor}"
                if prim.expr == "sum":
                    w(f"{acc} += tl.where(row_ok & col_ok, {val}, 0.0)", 2)
                else:
                    w(f'{acc} = tl.maximum({acc}, tl.where(row_ok & col_ok, {val}, float("-inf")))', 2)
            for t in outputs:
                emit_store(t, 2)
                stored.add(t)
            for prim in reduces:
                fn = "tl.sum" if prim.expr == "sum" else "tl.max"
                w(f"{_var(prim.output.tensor)} = {fn}(acc_{prim.output.tensor}, axis={plan.reduce_axis}){keep}", 1)
                done.add(prim.output.tensor)
            if plan.split > 1:
                emit_split_finish()
            emit_statistics()
    finish = sums_kernel() if plan.summed else None
    return sig, w.lines, doc, finish


_PRELUDE = '''import triton
import triton.language as tl

from datamove.kernels.interpreter import store_cast
from datamove.kernels.philox import dropout_keep, dropout_keep_grouped, keep_bits, unpack_gathered, unpack_rows


@triton.jit
def _tanh(x):
    return 2.0 * tl.sigmoid(2.0 * x) - 1.0
'''


def _kernel_name(op) -> str:
    return "".join(c if c.isalnum() else "_" for c in op.name)


def _signature(sig: list, rename=lambda n: n) -> list[str]:
    return ["    " + ", ".join(rename(n) for n in names) + "," + (f"  # {comment}" if comment else "")
            for names, comment in sig]


def _shared(name: str) -> bool:
    """Parameters named per part (sizes, dims, blocks, split buffers) rather than per tensor."""
    return name.startswith(("size_", "dim_", "BLOCK_", "split_"))


def _part_knobs(config: Configuration, count: int) -> list[dict]:
    """Per-part knobs (num_warps and dropout are the launch's, shared)."""
    knobs = config.knobs
    if count == 1:
        return [knobs]
    return [{**own, "num_warps": knobs["num_warps"], "dropout": knobs.get("dropout", "regenerate")}
            for own in knobs["parts"]]


def generate_source(graph, op, config: Configuration, *, index64: bool = False) -> str:
    """Triton source of ``op`` under ``config``: the kernel ``<op>_kernel`` (and, for an operator
    of several parts, one ``@triton.jit`` function per part, which the kernel calls on its
    program range ``[end_<k-1>, end_<k>)``; the last part takes the rest of the grid).

    ``index64``: compute indices in int64 (needed when an index can reach 2**31).
    """
    split = parts(op)
    name = _kernel_name(op)
    codes = [_part_code(graph, part, knobs, index64) for part, knobs in zip(split, _part_knobs(config, len(split)))]
    if len(split) == 1:
        sig, lines, doc, finish = codes[0]
        header = f'''"""Generated by kernels.codegen: operator {op.name} ({op.cls}).

{doc}
Layouts: {config.layouts}
"""
{_PRELUDE}

@triton.jit
def {name}_kernel('''
        pid = "    pid = tl.program_id(0)"
        source = [header] + _signature(sig) + ["):", pid] + lines
        if finish:
            source += ["", "", "@triton.jit", f"def {name}_sums_kernel("] + _signature(finish[0]) + ["):"] + finish[1]
        return "\n".join(source) + "\n"
    if any(finish for *_, finish in codes):
        raise NotImplementedError(f"{op.name}: column sums in an operator of several parts")
    docs = "\n\n".join(f"Part {k} (program range [end_{k - 1}, end_{k})):\n{doc}".replace("[end_-1", "[0")
                         for k, (_, _, doc, _) in enumerate(codes))
    out = [f'''"""Generated by kernels.codegen: operator {op.name} ({op.cls}), {len(split)} independent parts
in disjoint program ranges of one launch.

{docs}

Layouts: {config.layouts}
Knobs: {config.knobs}
"""
{_PRELUDE}''']
    for k, (sig, lines, _, _) in enumerate(codes):
        out += ["", "@triton.jit", f"def {name}_part{k}(", "    pid,  # program index within this part's range"]
        out += _signature(sig) + ["):"] + lines
    out += ["", "", "@triton.jit", f"def {name}_kernel("]
    per_part = lambda n, k: f"{n.split(':')[0]}_{k}{n[len(n.split(':')[0]):]}" if _shared(n) else n  # noqa: E731
    for k, (sig, *_) in enumerate(codes):  # runtime parameters, then the parts' program ranges, then blocks
        out += _signature([(names, c) for names, c in sig if not names[0].startswith("BLOCK_")], lambda n: per_part(n, k))
    out.append("    " + ", ".join(f"end_{k}" for k in range(len(split) - 1)) + ",  # where part k's program range ends")
    for k, (sig, *_) in enumerate(codes):
        out += _signature([(names, c) for names, c in sig if names[0].startswith("BLOCK_")], lambda n: per_part(n, k))
    out += ["):", "    pid = tl.program_id(0)"]
    for k, (sig, *_) in enumerate(codes):
        args = ", ".join(f"{n.split(':')[0]}_{k}" if _shared(n) else n for names, _ in sig for n in names)
        start = f" - end_{k - 1}" if k else ""
        if k == len(split) - 1:
            out += ["    else:" if k else "", f"        {name}_part{k}(pid{start}, {args})"]
        else:
            out += [f"    {'if' if k == 0 else 'elif'} pid < end_{k}:", f"        {name}_part{k}(pid{start}, {args})"]
    return "\n".join(out) + "\n"


# --- compiling and launching --------------------------------------------------------------------

def _load_module(source: str):
    digest = hashlib.sha256(source.encode()).hexdigest()[:20]
    if digest in _modules:
        return _modules[digest], CACHE_DIR / f"op_{digest}.py"
    CACHE_DIR.mkdir(parents=True, exist_ok=True)
    path = CACHE_DIR / f"op_{digest}.py"
    if not path.exists() or path.read_text() != source:
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(source)
        os.replace(tmp, path)
    spec = importlib.util.spec_from_file_location(f"datamove_generated_op_{digest}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    _modules[digest] = module
    return module, path


def allocate(graph, tensor: str, layout: str, dtype=torch.float32, device="cpu") -> torch.Tensor:
    """An empty tensor stored in ``layout`` (order of its letters), returned as a view whose shape
    follows the tensor's spec-order letters."""
    letters = graph.tensors[tensor].letters
    shape, strides = _strided(letters, tuple(graph.dim_values[graph.letter_dims[l]] for l in letters), layout)
    return torch.empty_strided(shape, strides, dtype=dtype, device=device)


@functools.lru_cache(maxsize=4096)
def _strided(letters: str, sizes: tuple, layout: str) -> tuple[tuple, tuple]:
    """(shape in ``letters`` order, strides of dense storage in ``layout``) for ``allocate``."""
    size = dict(zip(letters, sizes))
    stride, strides = 1, {}
    for letter in reversed(layout):
        strides[letter] = stride
        stride *= size[letter]
    return sizes, tuple(strides[l] for l in letters)


class CompiledOperator:
    """A generated kernel bound to a graph's dims; ``source`` is its Triton text, ``path`` its file.

    ``run(tensors, seeds)``: ``tensors`` {input name -> tensor with shape in spec-order letters,
    any strides}; ``seeds`` {dropout mask -> (seed, offset)} for regenerated masks (seed: an
    integer or a one-element int64 tensor on the device holding it).  Returns
    {output name -> tensor of spec-order shape stored in its configured layout}, of the dtype of
    the first loaded floating input that is not a mask; or writes into ``outputs`` (the same
    names, any strides) when given.  Indices are int32 unless some offset,
    extent or dropout index can reach 2**31 (then an int64 variant is generated).  An operator
    of several parts (``layouts.space.parts``) is one launch: the parts' program ranges one
    after the other.
    """

    def __init__(self, graph, op, config: Configuration):
        self.graph, self.op, self.config = graph, op, config
        self.parts = parts(op)
        self.part_knobs = _part_knobs(config, len(self.parts))
        self.plans = [_plan(graph, part, knobs) for part, knobs in zip(self.parts, self.part_knobs)]
        self.plan = self.plans[0] if len(self.plans) == 1 else None  # the single part's plan
        self.loads = tuple(t for plan in self.plans for t in plan.loads)  # every tensor read from memory
        self._kernels: dict[bool, object] = {}
        self._scratch: dict[tuple, object] = {}  # (part, device[, "sums"]) -> mode "split" / column sums' buffers
        self._bound = [(kind, t) for plan in self.plans for kind, names in (("load", plan.loads), ("output", plan.outputs))
                       for t in names]  # each part's loads, then its outputs: the kernel's pointer order
        self._templates: dict[tuple, tuple] = {}  # (shapes and strides, device) -> ``_template``
        self.scalars = graph.scalars()  # the dim_<name> float arguments' values
        self.source, self.path = self._variant(False)[1:]

    def _variant(self, index64: bool):
        source = generate_source(self.graph, self.op, self.config, index64=index64)
        module, path = _load_module(source)
        name = _kernel_name(self.op)
        self._kernels[index64] = (getattr(module, f"{name}_kernel"), getattr(module, f"{name}_sums_kernel", None))
        return self._kernels[index64], source, path

    def _size(self, plan: _Plan, letter: str) -> int:
        return self.graph.dim_values[plan.letters.dims[letter]]

    def _extent(self, plan: _Plan, group: str) -> int:
        total = 1
        for letter in group:
            total *= self._size(plan, letter)
        return total

    def _programs(self, plan: _Plan, knobs: dict) -> int:
        rows, cols = self._extent(plan, plan.rows), self._extent(plan, plan.cols)
        if plan.reduce_axis is None:
            return triton.cdiv(rows, knobs["block_row"]) * triton.cdiv(cols, knobs["block_col"])
        if plan.reduce_axis == 1:
            blocks = triton.cdiv(rows, knobs["block_row"])
            return min(blocks, knobs["programs"]) if plan.summed else blocks
        return self._extent(plan, plan.grid) * triton.cdiv(cols, knobs["block_col"]) * plan.split

    def _split_buffers(self, k: int, plan: _Plan, knobs: dict, device) -> list:
        """Part ``k``'s scratch of mode "split" on ``device``: [partial sums, arrival counters], made
        once (the counters zeroed; the kernel leaves them zero), so a CUDA graph can replay them."""
        key = (k, str(device))
        if key not in self._scratch:
            blocks = self._programs(plan, knobs) // plan.split
            self._scratch[key] = [
                torch.empty(len(plan.reduced_outputs) * plan.split * blocks * knobs["block_col"], dtype=torch.float32,
                            device=device),
                torch.zeros(blocks, dtype=torch.int32, device=device)]
        return self._scratch[key]

    def _sums_buffer(self, k: int, plan: _Plan, knobs: dict, device) -> torch.Tensor:
        """Part ``k``'s column sums of each program on ``device``, made once (each launch writes
        all of them before its sums kernel reads them), so a CUDA graph can replay them."""
        key = (k, str(device), "sums")
        if key not in self._scratch:
            self._scratch[key] = torch.empty(self._programs(plan, knobs) * len(plan.summed) * knobs["block_col"],
                                             dtype=torch.float32, device=device)
        return self._scratch[key]

    def grid(self) -> tuple[int]:
        return (sum(self._programs(plan, knobs) for plan, knobs in zip(self.plans, self.part_knobs)),)

    def run(self, tensors: dict, seeds: dict | None = None, outputs: dict | None = None) -> dict:
        if not outputs:
            loads = [tensors[t] for t in self.loads]
            reference = next((x for t, x in zip(self.loads, loads) if x.is_floating_point()
                              and self.graph.tensors[t].role != "dropout"), loads[0])
            outputs = {t: allocate(self.graph, t, self.config.layouts[t], reference.dtype, reference.device)
                       for plan in self.plans for t in plan.outputs}
        for launch, args in self._arguments(tensors, outputs, seeds or {}):
            launch(args)
        return outputs

    def _check_shapes(self, tensors: dict) -> None:
        for plan in self.plans:
            for t in plan.loads:
                expected = tuple(self._size(plan, l) for l in plan.letters.tensor_axes[t])
                if tuple(tensors[t].shape) != expected:
                    raise ValueError(f"{t}: shape {tuple(tensors[t].shape)} != {expected} "
                                     f"(spec order {plan.letters.tensor_axes[t]})")

    def warmup(self, dtype: torch.dtype, seeds: dict) -> None:
        """Compile for ``dtype`` inputs and outputs stored in the configured layouts, without
        running anything: fills Triton's on-disk cache, so that a later ``run`` in any process on
        the same GPU model only loads the binary (``harness.bench.Sweep`` compiles ahead in worker
        processes this way).  ``seeds`` as for ``run`` (their values take part in specialisation)."""
        stored = {t: allocate(self.graph, t, self.config.layouts.get(t, self.graph.tensors[t].letters), dtype, "meta")
                  for t in self.loads}
        outputs = {t: allocate(self.graph, t, self.config.layouts[t], dtype, "meta")
                   for plan in self.plans for t in plan.outputs}
        for launch, args in self._arguments(stored, outputs, seeds):
            launch.kernel.warmup(*(a.dtype if isinstance(a, torch.Tensor) else a for a in args), grid=launch.grid,
                                 **launch.kwargs)

    def _arguments(self, tensors: dict, outputs: dict, seeds: dict) -> list[tuple]:
        """[(launcher, positional args)] of the launches on ``tensors`` -> ``outputs`` (the kernel,
        then for column sums the kernel adding them up): the arguments' template (``_template``)
        made once per tensors' shapes, strides and device, filled with this call's tensors and
        seeds (host time per launch counts where nothing is graphed)."""
        bound = [tensors[t] if kind == "load" else outputs[t] for kind, t in self._bound]
        key = (tuple((tuple(x.shape), x.stride()) for x in bound), bound[0].device)
        template = self._templates.get(key)
        if template is None:  # first call with these shapes and strides: checked here, once
            self._check_shapes(tensors)
            template = self._templates[key] = self._template(bound)
        launches, grouped = template
        for t in grouped:
            if seeds[t][1] % DECISION_GROUP:
                raise ValueError(f"dropout mask {t}: counter offset {seeds[t][1]} is not a multiple of {DECISION_GROUP}, "
                                 f"which drawing whole groups of Philox calls needs (dataflow.executor.dropout_offsets)")
        result = []
        for launch, slots in launches:
            args = []
            for kind, value in slots:
                if kind == _TENSOR:
                    args.append(bound[value])
                elif kind == _SEED:
                    seed = seeds[value][0]
                    args += [seed if isinstance(seed, torch.Tensor) else int(seed), int(seeds[value][1])]
                else:
                    args.append(value)
            result.append((launch, args))
        return result

    def _template(self, bound: list) -> tuple:
        """([(launcher, argument slots)], grouped masks) for tensors shaped and strided as ``bound``
        (``self._bound``'s order): a launcher is a ``kernels.launch.DirectLaunch`` of the kernel (then,
        for column sums, of the kernel adding them up) on its grid with its constexprs; a slot is
        (_TENSOR, index into ``bound``), (_SEED, mask: its seed and counter offset) or (_VALUE, the argument)."""
        reach, slots, ends, blocks, grouped, n = [], [], [], {}, [], 0
        for k, (plan, part_knobs) in enumerate(zip(self.plans, self.part_knobs)):
            axes = plan.letters.tensor_axes
            mine = bound[n:n + len(plan.loads) + len(plan.outputs)]
            reach += [sum((size - 1) * abs(stride) for size, stride in zip(x.shape, x.stride())) for x in mine]
            reach += [self._extent(plan, axes[t]) for t in plan.regenerated] + [self._extent(plan, plan.letters.letters)]
            slots += [(_TENSOR, n + i) for i in range(len(mine))]
            slots += [(_VALUE, stride) for x in mine for stride in x.stride()]
            n += len(mine)
            slots += [(_VALUE, self._size(plan, l)) for l in plan.letters.letters]
            slots += [(_VALUE, self.scalars[d]) for d in plan.dim_names]
            slots += [(_SEED, t) for t in plan.regenerated]
            grouped += [t for t in plan.regenerated if t in plan.grouped + plan.row_grouped + plan.row_calls]
            suffix = "" if len(self.plans) == 1 else f"_{k}"
            if plan.split > 1:
                slots += [(_VALUE, x) for x in self._split_buffers(k, plan, part_knobs, mine[0].device)]
                blocks[f"BLOCK_SPLIT{suffix}"] = plan.split
            if plan.summed:
                sums = self._sums_buffer(k, plan, part_knobs, mine[0].device)
                slots.append((_VALUE, sums))
                blocks[f"BLOCK_PROGRAMS{suffix}"] = self._programs(plan, part_knobs)
                outputs = [n - len(plan.outputs) + plan.outputs.index(t) for t in plan.summed]  # indices into bound
                finish = [(_VALUE, sums)] + [(_TENSOR, i) for i in outputs]
                finish += [(_VALUE, stride) for i in outputs for stride in bound[i].stride()]
                finish += [(_VALUE, self._size(plan, l)) for l in plan.cols] + [(_VALUE, self._programs(plan, part_knobs))]
                finish_grid = (triton.cdiv(self._extent(plan, plan.cols), SUM_COLUMNS),)
                finish_blocks = {"BLOCK_COL": part_knobs["block_col"], "SUM_ROWS": SUM_ROWS, "SUM_COLUMNS": SUM_COLUMNS,
                                 "num_warps": 4}
            blocks[f"BLOCK_ROW{suffix}"] = part_knobs["block_row"]
            blocks[f"BLOCK_COL{suffix}"] = part_knobs["block_col"]
            ends.append((ends[-1] if ends else 0) + self._programs(plan, part_knobs))
        if len(self.plans) > 1:
            slots += [(_VALUE, end) for end in ends[:-1]]
        index64 = max(reach) >= 2 ** 31 - 1
        kernel, sums_kernel = self._kernels.get(index64) or self._variant(index64)[0]
        varying, n = [], 0  # argument positions of the tensors and seeds (strides, sizes, scalars: the template's)
        for kind, _ in slots:
            width = 2 if kind == _SEED else 1
            varying += range(n, n + width) if kind in (_TENSOR, _SEED) else []
            n += width
        launches = [(DirectLaunch(kernel, (ends[-1],), {**blocks, "num_warps": self.config.knobs["num_warps"]}, varying),
                     slots)]
        if sums_kernel is not None:
            launches.append((DirectLaunch(sums_kernel, finish_grid, finish_blocks,
                                          [n for n, (kind, _) in enumerate(finish) if kind == _TENSOR]), finish))
        return launches, tuple(grouped)


_TENSOR, _SEED, _VALUE = "tensor", "seed", "value"  # kinds of CompiledOperator._template's argument slots
_compiled: dict[tuple, CompiledOperator] = {}


def compile_operator(graph, op, config: Configuration) -> CompiledOperator:
    """Generate, cache and import the kernel of ``op`` under ``config`` at ``graph``'s dims."""
    key = (id(graph), op.name, tuple(sorted(graph.dim_values.items())), config.key(),
           tuple(p.name for p in op.primitives))
    if key not in _compiled:
        _compiled[key] = CompiledOperator(graph, op, config)
    return _compiled[key]
