"""What the code generator decides for one connected part of an operator under its knobs (the
tile's axes, what is loaded, which dropout masks are regenerated and how they are drawn), read
by the emitter (``kernels.codegen.emitter``) and the launcher (``kernels.codegen.compiled``)."""
from __future__ import annotations

from dataclasses import dataclass

from datamove.dataflow.dropout_mask import DECISION_GROUP
from datamove.kernels.codegen.expressions import names_used
from datamove.layouts.space import ROW_CALL_BLOCKS, OperatorLetters, grouped_masks, operator_letters, terminal_reductions, tile_axes


@dataclass(frozen=True)
class PartPlan:
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
    row_calls: tuple  # ... per column for BLOCK_ROW rows of one call, 64 G + 2 t + 8 i + e (``row_call_masks``)
    split: int  # row slices of mode "split" (1: none)
    reduced_outputs: tuple  # tensors the reduce primitives produce, in primitive order
    summed: tuple = ()  # the column sums' outputs (``layouts.space.column_sums``), in primitive order


def row_call_masks(graph, letters: OperatorLetters, rows: str, regenerated: tuple, block_row: int) -> tuple:
    """The masks of ``regenerated`` whose decisions can come from one Philox call per column for all
    ``block_row`` rows of a tile reduced along its columns: the row letters are the mask's trailing
    letters in spec order, their extent a multiple of 64, ``block_row`` one of ``ROW_CALL_BLOCKS``,
    and the program takes rows 64 G + 2 t + 8 i + e (e < 2) of call 4 G + t for ``block_row // 2``
    consecutive i (the program-id decomposition of ``PartEmitter``) instead of consecutive
    rows: ``block_row`` of the call's sixteen bytes (16 rows: all of them).  A row-reduction tile
    of one row per program draws one call per element; two rows already draw half as many."""
    if block_row not in ROW_CALL_BLOCKS:
        return ()
    return grouped_masks(graph, letters, rows, regenerated, DECISION_GROUP)


def _summed_outputs(op, letters: OperatorLetters, reduces: list, knobs: dict) -> list:
    """The outputs of ``reduces`` that are column sums; refuses reductions over other letter sets."""
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
    return summed


def plan_part(graph, op, knobs: dict) -> PartPlan:
    letters = operator_letters(graph, op)
    reduces = [p for p in op.primitives if p.kind == "reduce"]
    summed = _summed_outputs(op, letters, reduces, knobs)
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
            dim_names |= names_used(prim.expr, scalars)
    grouped = grouped_masks(graph, letters, cols, regenerated, knobs["block_col"])
    row_grouped = tuple(t for t in grouped_masks(graph, letters, rows, regenerated, knobs["block_row"]) if t not in grouped)
    row_calls = () if reduce_axis != 1 else tuple(
        t for t in row_call_masks(graph, letters, rows, regenerated, knobs["block_row"]) if t not in grouped + row_grouped)
    return PartPlan(letters, grid, rows, cols, reduce_axis, loads, regenerated, tuple(op.outputs), tuple(sorted(dim_names)),
                    grouped, row_grouped, row_calls, split, tuple(p.output.tensor for p in reduces), tuple(summed))
