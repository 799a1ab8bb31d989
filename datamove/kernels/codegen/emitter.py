"""The Triton body of one connected part of a fused element-wise / normalization operator
(``kernels.codegen``'s module doc describes the kernel it generates).

``PartEmitter(graph, op, knobs, index64).code()`` writes, from the program id ``pid``: the
tile's indices, then one of the emission modes (element-wise and mode "row": the expression DAG
once over the tile; column sums: "row" in a loop over blocks of rows; "loop": one pass over the
reduced axis per level of chained reductions; "split": "loop" over a slice of the rows, the last
slice to arrive adding up the partial sums), and for column sums the kernel adding them up.

A shuffle (``dataflow.shuffle``: rotate_half's einsum with a constant signed permutation) is a value
at a moved index: ``src = tl.where(idx_e < end, idx_e + shift, ...)`` per piece, its array loaded
there (``tl.load`` with ``src`` for ``idx_e`` in the offset, the same mask) times the piece's factor;
an array the operator computes is recomputed there from its maps' operands loaded at ``src``
(rotate_half's gradient: ``d_q * sin`` read at the moved index).
"""
from __future__ import annotations

from datamove.dataflow.shuffle import element_inputs, shuffle_of, source
from datamove.kernels.codegen.expressions import describe, describe_shuffle, triton_expression
from datamove.kernels.codegen.part_plan import plan_part
from datamove.kernels.interpreter import interpreted
from datamove.kernels.philox import dropout_scale, keep_threshold

# Elements per thread from which a mask grouped along the tile's columns exchanges its bits by
# ``tl.gather``: with fewer, Triton 3.6 may fail to compile the exchange (its thread-locality pass;
# cross-compiled for sm_90: BERT-large's bias + ReLU + dropout over ubj at 8 or 4 elements a thread,
# GPT-2's softmax + dropout over rows of 1024 at 16).
GATHER_ELEMENTS = 32
# The tile's two axes: (index variable, its bounds mask, the shape that broadcasts it, its extent,
# its block size, the variable of its block's first index)
_AXES = {"rows": ("row_ok", "[:, None]", "n_rows", "BLOCK_ROW", "row_start"),
         "cols": ("col_ok", "[None, :]", "n_cols", "BLOCK_COL", "col_start")}


class _Writer:
    def __init__(self):
        self.lines: list[str] = []

    def __call__(self, line: str = "", depth: int = 1):
        self.lines.append("    " * depth + line if line else "")


def _var(tensor: str) -> str:
    return f"v_{tensor}"


def _extent(group: str) -> str:
    return " * ".join(f"size_{l}" for l in group) if group else "1"


def _reduction(expr: str) -> tuple[str, str]:
    """(Triton reduction, neutral element) of a reduce primitive's ``expr`` ("sum", else max)."""
    return ("tl.sum", "0.0") if expr == "sum" else ("tl.max", 'float("-inf")')


def _inside(value: str, neutral: str) -> str:
    """``value`` where the tile's element lies inside the tensor, else ``neutral``."""
    return f"tl.where(row_ok & col_ok, {value}, {neutral})"


def _levels(graph, op) -> tuple[dict, int]:
    """({tensor: its depth of chained reductions}, the deepest reduction's depth)."""
    level: dict[str, int] = {t: 0 for t in op.inputs}
    for prim in op.primitives:
        deps = max(level[o.tensor] for o in element_inputs(graph, prim))
        level[prim.output.tensor] = deps + 1 if prim.kind == "reduce" else deps
    return level, max((level[p.output.tensor] for p in op.primitives if p.kind == "reduce"), default=0)


class PartEmitter:
    """The code of one connected part of ``op`` under ``knobs`` (``index64``: int64 indices); one
    emitter writes one part, once (``code``)."""

    def __init__(self, graph, op, knobs: dict, index64: bool):
        self.graph, self.op, self.knobs, self.index64 = graph, op, knobs, index64
        self.plan = plan = plan_part(graph, op, knobs)
        self.axes = plan.letters.tensor_axes
        self.producer = {p.output.tensor: p for p in op.primitives}
        self.shuffles = {p.name: s for p in op.primitives if (s := shuffle_of(graph, p)) is not None}
        self.scalars = graph.scalars()  # the names a map expression may use besides its operands
        self.w = _Writer()
        self.row_block = "rb" if plan.summed else "pid"  # the index of the block of rows a program takes (reduced along columns)
        self.tile_sums = knobs.get("sums_kept", "row") == "tile"  # column sums kept in a tile, its rows summed after the loop
        # column sums over row-call masks: a program's loop visits whole calls (rows of call 4 G + t, the
        # 16 // BLOCK_ROW blocks of its bytes in turn), drawing each column's call once, not once a block
        self.call_loop = bool(plan.summed and plan.row_calls)
        self.reduced_letters = plan.cols if plan.reduce_axis == 1 else plan.rows if plan.reduce_axis == 0 else ""
        self.loop_axis = "cols" if plan.reduce_axis == 1 else "rows"  # the reduced axis (modes "row", "loop")
        self.kept = "[:, None]" if plan.reduce_axis == 1 else "[None, :]"  # a reduced row's shape in the tile
        self.level, self.n_pass = _levels(graph, op)
        self.done: set[str] = set()  # mode "loop": values computed outside the passes' loops
        self.stored: set[str] = set()  # mode "loop": outputs stored

    def code(self) -> tuple[list, list[str], str, tuple | None]:
        """(signature [(parameter names, comment)], body lines at depth 1 starting from the program
        id ``pid``, a description for the docstring, and for column sums the (signature, body) of
        the kernel that adds up each program's sums)."""
        sig, doc = self.signature(), self.doc()
        self._emit_tile()
        if self.plan.reduce_axis is None or self.knobs["mode"] == "row":
            self._emit_whole_rows()
        else:
            self._emit_passes()
        finish = self.sums_kernel() if self.plan.summed else None
        return sig, self.w.lines, doc, finish

    # --- the signature and the docstring ----------------------------------------------------------

    def _pointer(self, t: str, role: str) -> tuple:
        return [f"{t}_ptr"], f"{self.axes[t]} (spec order {self.graph.tensors[t].letters}), any strides: {role}"

    def _strides(self, tensors) -> list:
        return [([f"stride_{t}_{l}" for l in self.axes[t]], "") for t in tensors if self.axes[t]]

    def signature(self) -> list:
        plan, L = self.plan, self.plan.letters
        sig = [self._pointer(t, "input") for t in plan.loads] + [self._pointer(t, "output") for t in plan.outputs]
        sig += self._strides(list(plan.loads) + list(plan.outputs))
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
        return sig

    def doc(self) -> str:
        plan, L = self.plan, self.plan.letters
        prims_doc = "\n".join("    " + (describe_shuffle(p, self.shuffles[p.name], L.prim_letters[p.name])
                                       if p.name in self.shuffles else describe(p, L.prim_letters[p.name]))
                               for p in self.op.primitives)
        return f"""{prims_doc}

Letters: {", ".join(f"{l}={L.dims[l]}" for l in L.letters)}; reduced: {L.reduced or "-"}.
Grid letters: {plan.grid or "-"}; tile rows: {plan.rows or "-"}; tile columns: {plan.cols or "-"}.
Knobs: {self.knobs}"""

    # --- program ids and index decomposition ----------------------------------------------------

    def _decompose(self, flat: str, group: str, shape: str, depth: int = 1):
        """idx_<l> for the letters of ``group`` flattened row-major in ``flat`` (shape suffix)."""
        rem = flat
        for pos, letter in enumerate(reversed(group)):
            if pos == len(group) - 1:
                self.w(f"idx_{letter} = {rem}{shape}", depth)
            else:
                self.w(f"idx_{letter} = ({rem} % size_{letter}){shape}", depth)
                self.w(f"{flat}_rest{pos} = {rem} // size_{letter}", depth)
                rem = f"{flat}_rest{pos}"

    def _emit_indices(self, axis: str, depth: int = 1):
        """The bounds mask of ``axis`` ("rows" or "cols") and the indices of its letters."""
        ok, shape, n, _, _ = _AXES[axis]
        self.w(f"{ok} = ({axis} < {n}){shape}", depth)
        self._decompose(axis, self.plan.cols if axis == "cols" else self.plan.rows, shape, depth)

    def _emit_tile(self):
        """The tile's extents, its program's rows and columns, their masks and letter indices."""
        plan, w = self.plan, self.w
        if self.index64:
            w("pid = pid.to(tl.int64)")
        w(f"n_rows = {_extent(plan.rows)}")
        w(f"n_cols = {_extent(plan.cols)}")
        if plan.reduce_axis is None:
            w("col_blocks = tl.cdiv(n_cols, BLOCK_COL)")
            w("row_start = (pid // col_blocks) * BLOCK_ROW")
            w("rows = row_start + tl.arange(0, BLOCK_ROW)")
            w("col_start = (pid % col_blocks) * BLOCK_COL")
            w("cols = col_start + tl.arange(0, BLOCK_COL)")
        elif plan.reduce_axis == 1 and not plan.summed:
            self._emit_row_block(1)
        elif plan.reduce_axis == 0:
            self._emit_column_block()
        if self.index64:
            for axis in ("rows", "cols") if plan.reduce_axis is None else (("rows",) if plan.reduce_axis == 1 else ("cols",)):
                if not (axis == "rows" and plan.summed):
                    w(f"{axis} = {axis}.to(tl.int64)")
        if plan.reduce_axis != 0 and not plan.summed:
            self._emit_indices("rows")
        if plan.reduce_axis != 1:
            self._emit_indices("cols")
        for t in plan.regenerated:  # logical row-major strides over the mask's spec-order letters
            spec_axes = self.axes[t]
            for pos, letter in enumerate(spec_axes):
                inner = spec_axes[pos + 1:]
                w(f"lstride_{t}_{letter} = {' * '.join(f'size_{l}' for l in inner) if inner else '1'}")

    def _emit_column_block(self):
        """A reduction along the rows: the program's block of columns and its grid letters' indices."""
        w = self.w
        if self.plan.split > 1:  # the BLOCK_SPLIT programs of a column block are neighbours
            w("row_slice = pid % BLOCK_SPLIT")
            w("pid = pid // BLOCK_SPLIT")
        w("col_blocks = tl.cdiv(n_cols, BLOCK_COL)")
        w("col_start = (pid % col_blocks) * BLOCK_COL")
        w("cols = col_start + tl.arange(0, BLOCK_COL)")
        w("g = pid // col_blocks")
        self._decompose("g", self.plan.grid, "")

    def _emit_row_block(self, depth: int):
        """rows (and, inside a loop over blocks of rows, row_ok and the row letters' indices) of block ``row_block``."""
        w, plan, row_block = self.w, self.plan, self.row_block
        if self.call_loop:  # inside the loop over calls rc = 4 G + t, block rq of its bytes
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
            if self.index64:
                w("rows = rows.to(tl.int64)", depth)
            self._emit_indices("rows", depth)

    # --- values: loads, regenerated dropout masks, maps, stores -----------------------------------

    def _mask_of(self, tensor_letters: str) -> str | None:
        parts = [name for group, name in ((self.plan.rows, "row_ok"), (self.plan.cols, "col_ok"))
                 if any(l in group for l in tensor_letters)]
        return " & ".join(parts) or None

    def _offset_of(self, t: str) -> str:
        return " + ".join(f"idx_{l} * stride_{t}_{l}" for l in self.axes[t]) or "0"

    def _mask_base(self, t: str, along: str) -> str:
        """The logical index of mask ``t``'s element over its letters not in ``along``, each term + ..."""
        return "".join(f"idx_{l} * lstride_{t}_{l} + " for l in self.axes[t] if l not in along)

    def _row_call_bits(self, t: str) -> str:
        """uint16 [1, BLOCK_COL]: the keep decisions of call 4 G + t of each column of row-call mask ``t``."""
        calls = (f"((offset_{t} + {self._mask_base(t, self.plan.rows)}row_group * 64) >> 4) + "
                 f"{'rc' if self.call_loop else self.row_block} % 4")
        return f"keep_bits(seed_{t}, {calls}, {keep_threshold(self.graph.tensors[t].p)})"

    def _keep(self, t: str, threshold) -> tuple[str, str]:
        """(the keep decisions of regenerated mask ``t`` over the tile, how they are drawn)."""
        plan, knobs = self.plan, self.knobs
        if t in plan.grouped:  # column 64 G + 8 i + 2 t + e of the block: byte 2 i + e of call (col start) // 16 + 4 G + t
            calls = f"((offset_{t} + {self._mask_base(t, plan.cols)}col_start) >> 4) + tl.arange(0, BLOCK_COL // 16)[None, :]"
            if knobs["block_row"] * knobs["block_col"] >= GATHER_ELEMENTS * 32 * knobs["num_warps"]:
                return f"unpack_gathered(keep_bits(seed_{t}, {calls}, {threshold}))", "one Philox call per sixteen columns"
            return f"dropout_keep_grouped(seed_{t}, {calls}, {threshold})", "one Philox call per sixteen columns"
        if t in plan.row_grouped:  # the same along rows, on the transposed block of calls
            calls = f"((offset_{t} + {self._mask_base(t, plan.rows)}row_start) >> 4) + tl.arange(0, BLOCK_ROW // 16)[:, None]"
            return (f"tl.trans(dropout_keep_grouped(seed_{t}, tl.trans({calls}), {threshold}))",
                    "one Philox call per sixteen rows")
        if t in plan.row_calls and self.call_loop:  # drawn once per call, before its blocks
            return f"unpack_rows(bits_{t}, row_byte, BLOCK_ROW)", "the bytes of the block's rows in its column's call"
        if t in plan.row_calls:  # row r of the block: byte (first byte) + r of the one call of its column
            return f"unpack_rows({self._row_call_bits(t)}, row_byte, BLOCK_ROW)", "one Philox call per column for the block's rows"
        index = " + ".join(f"idx_{l} * lstride_{t}_{l}" for l in self.axes[t])
        return f"dropout_keep(seed_{t}, offset_{t}, {index}, {threshold})", "one Philox call per element"

    def _emit_input(self, t: str, depth: int):
        if t in self.plan.regenerated:
            info = self.graph.tensors[t]
            keep, note = self._keep(t, keep_threshold(info.p))
            self.w(f"{_var(t)} = tl.where({keep}, {dropout_scale(info.p)!r}, 0.0)  # dropout mask {t}[{self.axes[t]}] "
                   f"regenerated, {note}", depth)
        else:
            mask = self._mask_of(self.axes[t])
            extra = f", mask={mask}, other=0.0" if mask else ""
            self.w(f"{_var(t)} = tl.load({t}_ptr + {self._offset_of(t)}{extra}).to(tl.float32)", depth)

    def _emit_map(self, prim, depth: int):
        """A map's value, or a shuffle's (``_emit_shuffle``)."""
        if prim.name in self.shuffles:
            self._emit_shuffle(prim, depth)
            return
        expr = triton_expression(prim.expr, [_var(o.tensor) for o in prim.inputs], self.scalars)
        self.w(f"{_var(prim.output.tensor)} = {expr}", depth)

    def _emit_shuffle(self, prim, depth: int):
        """``out[..., e] = factor * x[..., e + shift]`` per piece: the moved index ``src_<out>``, the
        array's value there (``_moved``), the factor."""
        shuffle, out = self.shuffles[prim.name], prim.output.tensor
        letter = self.plan.letters.prim_letters[prim.name][shuffle.letter]
        names = {dim: f"size_{l}" for l, dim in reversed(self.plan.letters.dims.items())}
        names[self.plan.letters.dims[letter]] = f"size_{letter}"
        names = {dim: names.get(dim, str(value)) for dim, value in self.graph.dim_values.items()}
        pieces = sorted(shuffle.pieces, key=lambda piece: piece.values(self.graph.dim_values)[0])
        index = factor = None
        for piece in reversed(pieces):  # the pieces in order along e: each below its end, the last the rest
            moved = f"idx_{letter} + ({source(piece.shift, names)})"
            below = f"idx_{letter} < {source(piece.end, names)}"
            index = moved if index is None else f"tl.where({below}, {moved}, {index})"
            factor = repr(piece.factor) if factor is None else f"tl.where({below}, {piece.factor!r}, {factor})"
        self.w(f"src_{out} = {index}  # {prim.inputs[shuffle.source].tensor}'s index along {letter} "
               f"for {out}'s (a constant signed permutation, {shuffle.constant})", depth)
        value = self._moved(prim.inputs[shuffle.source].tensor, letter, f"src_{out}", out, depth)
        self.w(f"{_var(out)} = {value}" + ("" if all(p.factor == 1 for p in pieces) else f" * {factor}"), depth)

    def _moved(self, t: str, letter: str, index: str, tag: str, depth: int) -> str:
        """The variable of tensor ``t``'s value with ``index`` for ``idx_<letter>``: an input loaded
        there, a value without that letter as it is, a map's recomputed from its operands moved."""
        if t in self.op.inputs and t not in self.plan.regenerated:
            mask = self._mask_of(self.axes[t])
            extra = f", mask={mask}, other=0.0" if mask else ""
            offset = " + ".join(f"{index if l == letter else f'idx_{l}'} * stride_{t}_{l}" for l in self.axes[t]) or "0"
            self.w(f"{_var(t)}_{tag} = tl.load({t}_ptr + {offset}{extra}).to(tl.float32)", depth)
            return f"{_var(t)}_{tag}"
        if letter not in self.axes[t]:
            return _var(t)
        prim = self.producer.get(t)
        if prim is None or prim.kind != "map":
            raise NotImplementedError(f"{self.op.name}: a shuffle of {t} ({'a dropout mask' if prim is None else prim.kind}) "
                                      "read at a moved index")
        own = self.plan.letters.prim_letters[prim.name]
        operands = [self._moved(o.tensor, letter, index, tag, depth) if any(own[l] == letter for l in o.letters)
                    else _var(o.tensor) for o in prim.inputs]
        self.w(f"{_var(t)}_{tag} = {triton_expression(prim.expr, operands, self.scalars)}", depth)
        return f"{_var(t)}_{tag}"

    def _emit_store(self, t: str, depth: int):
        mask = self._mask_of(self.axes[t])
        extra = f", mask={mask}" if mask else ""
        value = f"store_cast({_var(t)}, {t}_ptr)" if interpreted() else f"{_var(t)}.to({t}_ptr.dtype.element_ty)"
        self.w(f"tl.store({t}_ptr + {self._offset_of(t)}, {value}{extra})", depth)

    # --- element-wise and mode "row" (column sums: in a loop over blocks of rows) ----------------

    def _emit_whole_rows(self):
        """The expression DAG once over the tile, which holds whole reduction rows."""
        plan, w = self.plan, self.w
        depth = 1
        if plan.reduce_axis is not None:  # the tile holds the whole reduced axis, from its start
            axis = self.loop_axis
            w(f"{_AXES[axis][4]} = 0")
            w(f"{axis} = tl.arange(0, {_AXES[axis][3]})")
            self._emit_indices(axis)
        inputs = list(self.op.inputs)
        if plan.summed:
            inputs, depth = self._emit_sums_loop()
        for t in inputs:
            self._emit_input(t, depth)
        for prim in self.op.primitives:
            self._emit_row_primitive(prim, depth)
        for t in plan.outputs:
            if t not in plan.summed:
                self._emit_store(t, depth)
        if plan.summed:
            self._emit_sums_partials()

    def _emit_row_primitive(self, prim, depth: int):
        t = prim.output.tensor
        if prim.kind in ("map", "einsum"):  # an einsum here is a shuffle
            self._emit_map(prim, depth)
        elif t in self.plan.summed:
            rows = _inside(_var(prim.inputs[0].tensor), "0.0")
            self.w(f"acc_{t} += {rows if self.tile_sums else f'tl.sum({rows}, axis=0)[None, :]'}", depth)
        else:
            fn, neutral = _reduction(prim.expr)
            self.w(f"{_var(t)} = {fn}({_inside(_var(prim.inputs[0].tensor), neutral)}, "
                   f"axis={self.plan.reduce_axis}){self.kept}", depth)

    def _emit_sums_loop(self) -> tuple[list, int]:
        """Column sums: the loop over every BLOCK_PROGRAMS-th block of rows, from the program's own;
        (the inputs to load in it, the depth of its body)."""
        plan, w = self.plan, self.w
        inputs = [t for t in self.op.inputs if any(l in plan.rows for l in self.axes[t])]
        for t in self.op.inputs:  # read once: what has no row letter (a layernorm's gamma)
            if t not in inputs:
                self._emit_input(t, 1)
        for t in plan.summed:  # each block's rows added into a row of registers (or a tile: sums_kept)
            w(f"acc_{t} = tl.zeros([{'BLOCK_ROW' if self.tile_sums else '1'}, BLOCK_COL], tl.float32)")
        if self.call_loop:
            w("for rc in range(pid, tl.cdiv(n_rows, 64) * 4, BLOCK_PROGRAMS):  # rows of call 4 G + t of every column")
            w("row_group = rc // 4  # G", 2)
            for t in plan.row_calls:
                w(f"bits_{t} = {self._row_call_bits(t)}", 2)
            w("for rq in range(16 // BLOCK_ROW):", 2)
            depth = 3
        else:
            w(f"for {self.row_block} in range(pid, tl.cdiv(n_rows, BLOCK_ROW), BLOCK_PROGRAMS):")
            depth = 2
        self._emit_row_block(depth)
        return inputs, depth

    def _emit_sums_partials(self):
        """Each program's column sums into its row of ``sums`` (plain stores: a value its threads hold
        twice is stored twice, never added twice); ``<op>_sums_kernel`` adds the rows up."""
        for r, t in enumerate(self.plan.summed):
            acc = f"tl.sum(acc_{t}, axis=0)[None, :]" if self.tile_sums else f"acc_{t}"
            self.w(f"tl.store(sums_ptr + (pid * {len(self.plan.summed)} + {r}) * BLOCK_COL + cols[None, :], {acc}, "
                   "mask=col_ok)")

    def sums_kernel(self) -> tuple[list, list[str]]:
        """(signature, body) of the kernel adding the programs' column sums and storing them: one
        program per ``SUM_COLUMNS`` columns, ``SUM_ROWS`` programs' sums per load."""
        plan = self.plan
        n = len(plan.summed)
        fsig = [(["sums_ptr"], f"float32 [programs, {n}, BLOCK_COL]: each program's column sums")]
        fsig += [self._pointer(t, "output") for t in plan.summed] + self._strides(plan.summed)
        fsig += [([f"size_{l}" for l in plan.cols], ""), (["programs"], "programs of the main kernel"),
                 (["BLOCK_COL: tl.constexpr", "SUM_ROWS: tl.constexpr", "SUM_COLUMNS: tl.constexpr"], "")]
        main, w = self.w, _Writer()
        self.w = w
        w("pid = tl.program_id(0)")
        w(f"n_cols = {_extent(plan.cols)}")
        w("cols = pid * SUM_COLUMNS + tl.arange(0, SUM_COLUMNS)")
        self._emit_indices("cols")
        for t in plan.summed:
            w(f"{_var(t)} = tl.zeros([1, SUM_COLUMNS], tl.float32)")
        w("for start in range(0, programs, SUM_ROWS):  # program order")
        w("rows = (start + tl.arange(0, SUM_ROWS))[:, None]", 2)
        for r, t in enumerate(plan.summed):
            w(f"{_var(t)} += tl.sum(tl.load(sums_ptr + (rows * {n} + {r}) * BLOCK_COL + cols[None, :], "
              "mask=(rows < programs) & col_ok, other=0.0), axis=0)[None, :]", 2)
        for t in plan.summed:
            self._emit_store(t, 1)
        self.w = main
        return fsig, w.lines

    # --- modes "loop" and "split": one pass per reduction level, then the outputs -----------------

    def _emit_passes(self):
        for t in self.op.inputs:  # inputs without reduced letters: once, before the passes
            if not any(l in self.reduced_letters for l in self.axes[t]):
                self._emit_input(t, 1)
                self.done.add(t)
        self._emit_statistics()
        if self.plan.split > 1:
            self.w("slice_rows = tl.cdiv(tl.cdiv(n_rows, BLOCK_SPLIT), BLOCK_ROW) * BLOCK_ROW", 1)
            self.w("slice_start = row_slice * slice_rows", 1)
            first, end = "slice_start", "tl.minimum(slice_start + slice_rows, n_rows)"
        else:
            first, end = "0", _AXES[self.loop_axis][2]
        for pass_no in range(self.n_pass + 1):
            self._emit_pass(pass_no, first, end)

    def _emit_statistics(self):
        """The maps computable outside the passes' loops (no reduced letter, operands done), and
        the outputs among them."""
        progress = True
        while progress:
            progress = False
            for prim in self.op.primitives:
                t = prim.output.tensor
                if (prim.kind == "map" and t not in self.done and not any(l in self.reduced_letters for l in self.axes[t])
                        and all(o.tensor in self.done for o in prim.inputs)):
                    self._emit_map(prim, 1)
                    self.done.add(t)
                    progress = True
        for t in self.plan.outputs:
            if t in self.done and t not in self.stored:
                self._emit_store(t, 1)
                self.stored.add(t)

    def _emit_pass(self, pass_no: int, first: str, end: str):
        """Pass ``pass_no``: the reductions of level ``pass_no + 1`` and the outputs of level ``pass_no``."""
        plan, w, level = self.plan, self.w, self.level
        reduces = [p for p in self.op.primitives if p.kind == "reduce" and level[p.output.tensor] == pass_no + 1]
        outputs = [t for t in plan.outputs if t not in self.done and t not in self.stored and level[t] == pass_no]
        targets = [p.inputs[0].tensor for p in reduces] + outputs
        if not targets:
            return
        w(f"# pass {pass_no + 1}: " + ", ".join(
            [f"{p.expr} -> {p.output.tensor}" for p in reduces] + ([f"store {', '.join(outputs)}"] if outputs else [])), 1)
        for prim in reduces:
            init = "tl.zeros" if prim.expr == "sum" else "tl.full"
            extra = "" if prim.expr == "sum" else ', float("-inf")'
            w(f"acc_{prim.output.tensor} = {init}([BLOCK_ROW, BLOCK_COL]{extra}, tl.float32)", 1)
        axis = self.loop_axis
        block = _AXES[axis][3]
        w(f"for start in range({first}, {end}, {block}):", 1)
        w(f"{_AXES[axis][4]} = start", 2)
        w(f"{axis} = start + tl.arange(0, {block})", 2)
        self._emit_indices(axis, 2)
        self._emit_pass_values(targets)
        for prim in reduces:
            val, acc = _var(prim.inputs[0].tensor), f"acc_{prim.output.tensor}"
            if prim.expr == "sum":
                w(f"{acc} += {_inside(val, '0.0')}", 2)
            else:
                w(f'{acc} = tl.maximum({acc}, {_inside(val, _reduction(prim.expr)[1])})', 2)
        for t in outputs:
            self._emit_store(t, 2)
            self.stored.add(t)
        for prim in reduces:
            fn = _reduction(prim.expr)[0]
            w(f"{_var(prim.output.tensor)} = {fn}(acc_{prim.output.tensor}, axis={plan.reduce_axis}){self.kept}", 1)
            self.done.add(prim.output.tensor)
        if plan.split > 1:
            self._emit_split_finish()
        self._emit_statistics()

    def _needed(self, targets: list[str], available: set) -> list:
        """Primitives (in order) computing ``targets`` from the ``available`` values and inputs."""
        want, stack = set(), list(targets)
        while stack:
            t = stack.pop()
            if t in want or t in available or t not in self.producer:
                continue
            want.add(t)
            if self.producer[t].name not in self.shuffles:  # a shuffle computes what it reads itself
                stack.extend(o.tensor for o in self.producer[t].inputs)
        return [p for p in self.op.primitives if p.output.tensor in want]

    def _emit_pass_values(self, targets: list[str]):
        """Inside a pass's loop: the loads and maps that ``targets`` need beyond what is done."""
        local = set(self.done)
        for prim in self._needed(targets, self.done):
            for o in () if prim.name in self.shuffles else prim.inputs:
                if o.tensor not in local and o.tensor not in self.producer:
                    self._emit_input(o.tensor, 2)
                    local.add(o.tensor)
            if prim.output.tensor not in local:
                self._emit_map(prim, 2)
                local.add(prim.output.tensor)
        for t in targets:
            if t not in local and t in self.op.inputs:
                self._emit_input(t, 2)

    def _emit_split_finish(self):
        """Partial sums out; the column block's last slice to arrive adds them and stores the outputs."""
        w, plan = self.w, self.plan
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
            self._emit_store(t, 2)
            self.stored.add(t)
        w("tl.store(split_arrivals_ptr + pid, 0)  # ready for the next launch", 2)
