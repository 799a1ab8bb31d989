"""Layout spaces of fused element-wise and normalization operators.

A tensor's *layout* is an order of its letters (its ``TensorInfo.letters``), outermost first;
strides follow row-major in that order, e.g. ``x`` over ``"ibj"`` in layout ``"bji"`` has
stride 1 along i.  A *configuration* of a non-contraction operator is
``Configuration(layouts, knobs)``:

- ``layouts``: {external tensor name -> layout}, one per input and output of the operator.
  A tensor shared with other operators must get one layout across the graph, so the global
  layout search picks configurations whose per-tensor choices agree (``fixed=`` below).
- ``knobs`` (operator letters, see ``operator_letters``):
    ``vector``    the tile's contiguous (vectorised) letter;
    ``order``     all operator letters, outer -> inner, ``vector`` last: the order in which the
                  kernel flattens the letters that share a tile axis or the program grid;
    ``mode``      "tile" (element-wise: 2-D tiles over the whole space), "row" (normalization:
                  a program holds whole reduction rows), "loop" (normalization: a program loops
                  over chunks of the reduction, one pass per chained reduction plus one),
                  "split" (a reduction along the tile's rows whose results no other primitive
                  reads, such as a bias gradient over (b, j): ``split`` programs share one
                  column block, each loops over its slice of the rows, and the last of them to
                  finish adds the partial sums in slice order and stores the result);
    ``split``     the number of row slices (mode "split" only);
    ``programs``  an operator with column sums (``column_sums``: a layernorm backward with its
                  parameter gradients): mode "row" on this many programs (at most one per block
                  of rows), each visiting every ``programs``-th block of rows and storing its
                  column sums, which a second kernel adds up;
    ``sums_kept`` (with ``programs``) where a program keeps its column sums: "row" (each block's
                  rows added into one row of registers as it goes) or "tile" (a tile of registers
                  the blocks are added into, its rows summed once after the loop: no reduction
                  across the tile's rows per block, at the price of BLOCK_ROW times the
                  registers; absent means "row");
    ``block_row``, ``block_col``  tile sizes (powers of two) of the tile's two axes;
    ``num_warps``;
    ``dropout``   "regenerate" (Philox from (seed, offset)) or "load" (read a stored mask).

Kernel axes (``tile_axes``): element-wise -> columns = ``vector``, rows = the other letters;
normalization with ``vector`` reduced -> columns = reduced letters (reduced along columns),
rows = independent letters; normalization with ``vector`` independent -> columns = ``vector``,
rows = reduced letters (reduced along rows), the other independent letters one per program.

Pruning (``exhaustive=False``), after the paper's two good groups:
1. the vector letter is contiguous (last) in every external tensor that has it: loads and stores
   along the tile's column axis are then unit-stride and coalesced / vectorised;
2. (dropped: a normalization's vector letter may be independent, its reduction then running
   along the tile's rows: strided, but what lets a reduction over (b, j) read activations stored
   feature-innermost without a layout change, which the global selection weighs);
3. one relative order of letters for all the operator's tensors (``order``): the outer letters
   only change the order in which programs touch memory, not coalescing, so per-tensor
   permutations of them multiply the space without a new access pattern;
4. knobs: power-of-two blocks no larger than the extent they tile; "row" only when a whole
   row fits 16384 fp32 registers per program, "loop" only when the row is longer than one
   chunk; at most 16384 elements per tile; at least 4 elements per thread (or one warp);
   "split" with the power-of-two number of slices that brings the programs to about
   ``SPLIT_PROGRAMS`` (a slice at least one chunk long), and only where it is more than one.
``exhaustive=True`` drops rules 1 and 3 (every permutation of every tensor).

Operators of several parts (``parts``): a fused operator whose primitives share no tensor
falls into independent *parts* (fusion's stacked operators: one part per stack member, e.g.
three bias adds over phbj / phbk / whbk; a bias-gradient reduction joined across a contraction:
one part over ibj and one over ubj).  Each part has its own letters, iteration space and
tile; the kernel runs them in disjoint program ranges of one launch.  Their configuration is
``knobs = {"parts": (part knobs, ...), "num_warps": w, "dropout": ...}`` where each part's
knobs are those above without ``num_warps`` / ``dropout`` (one launch, one warp count).
5. parts run in disjoint programs, so their times add and the best combination is the best
   choice per part: the multi-part space is the all-default configuration
   (``default_configuration``), then every part's pruned space with the other parts at their
   defaults (the sum, not the product, of the part spaces).  What the product would add, each
   part at its own best, the selection prices from these measurements
   (``datamove.candidates.CandidateBuilder.composed``) and the main job measures once chosen.
"""
from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass
from typing import NamedTuple

from datamove.dataflow.dropout_mask import DECISION_GROUP, DECISIONS_PER_CALL
from datamove.dataflow.operators import ELEMENTWISE, NORMALIZATION, make_operator
from datamove.dataflow.shuffle import element_inputs, shuffle_of
from datamove.dataflow.union_find import UnionFind

MAX_TILE = 16384  # fp32 elements per program tile (register budget)
# Modes a first stage measures an access pattern with (one pass over the data, enough programs):
# whole rows, tiles, or a reduction along rows split over programs.
PLAIN_MODES = ("tile", "row", "split")
PLAIN_TILE = 4096  # ... with tiles of at most 32 fp32 values per thread at 4 warps (larger ones spill registers)
# Element-wise tiles: elements per program, and the column blocks each is tried with.  The square
# and 64-row tiles draw a dropout mask whose counters run along the tile's rows sixteen decisions
# per Philox call (``grouped_masks`` needs a block of whole 64-counter groups): BERT-large's bias +
# ReLU + dropout stored bju with its mask over ubj ran 25.3 us at 128 x 32 (the only such tile
# before), 22.1 at 64 x 64 and 22.0 at 64 x 128 (H200, a same-size copy 18.5).
ELEMENTWISE_TILES = (1024, 4096, 8192)
ELEMENTWISE_COLUMNS = (32, 64, 128, 512)
SPLIT_PROGRAMS = 512  # programs a "split" reduction aims at (a few per multiprocessor of an H100 / H200)
# Programs an operator with column sums is tried with (each visits rows in turn and stores its sums, which
# a second kernel adds up: more programs, more sums to store and add; 1024 took 1.5x the time of 256 on
# BERT-large's layernorm backwards, H100).
SUM_PROGRAMS = (128, 256, 512)
# Where such a program keeps its sums (knob ``sums_kept``).  H100, bf16, each join alone (L2 flushed),
# 4 rows a block, 4 warps, 256 programs: BERT-large's LN2 join 26.1 us per block, 24.8 as a tile
# (B=96 L=128: 60.1 / 57.1), its LN1 join 29.4 / 28.4 (B=96: 67.0 both); GPT-2's LN2 join 34.4 / 29.6,
# its LN1 join 19.6 / 20.7.  255 registers a thread either way (2 rows a block: 128 per block, 168 as a tile).
SUMS_KEPT = ("row", "tile")
# Rows per program of a reduction along the tile's columns whose dropout masks run along its rows:
# each takes rows of one Philox call per column (``kernels.codegen._row_call_masks``).
ROW_CALL_BLOCKS = (2, 4, 8, DECISIONS_PER_CALL)


class Configuration(NamedTuple):
    """(per-tensor layouts {name: order of its letters}, knobs {name: value})."""

    layouts: dict
    knobs: dict

    def key(self) -> str:
        """A stable text key (tuning database, caches)."""
        lay = ",".join(f"{t}:{self.layouts[t]}" for t in sorted(self.layouts))
        kn = ",".join(f"{k}={self.knobs[k]}" for k in sorted(self.knobs))
        return f"{lay}|{kn}"


@dataclass(frozen=True)
class OperatorLetters:
    """The operator's letters unified over its primitives.

    Primitives name their own iteration letters; an operator (fused, backward) may name the same
    dim differently in two primitives.  Letters are unified through the tensors they index
    (axis n of a tensor is one dim wherever it is read), then classes that share a primitive letter
    but no tensor are joined (``_join_same_names``), and each class takes the letter of the
    first external tensor axis in it (else the first primitive letter).

    tensor_axes: {tensor -> operator letter of each axis, in the tensor's spec order}
    prim_letters: {primitive name -> {primitive letter -> operator letter}}
    letters: every operator letter; reduced: letters reduced by the reduce primitives (but those
    of ``summed``); dims: {operator letter -> dim name}; summed: see ``column_sums``.
    """

    tensor_axes: dict
    prim_letters: dict
    letters: str
    reduced: str
    dims: dict
    summed: str = ""  # letters of column sums over the rows of a tile reduced along ``reduced`` (``column_sums``)

    @property
    def independent(self) -> str:
        return "".join(l for l in self.letters if l not in self.reduced)


@dataclass(frozen=True)
class Part:
    """A connected part of an operator: primitives linked by the tensors they share, with the
    operator's inputs they read and its outputs they write (each in the operator's order)."""

    name: str
    cls: str
    primitives: tuple
    inputs: tuple
    outputs: tuple


def parts(op) -> list[Part]:
    """The connected parts of ``op`` (primitives joined through any tensor they read or write,
    but a shuffle's constant, which is no input of the operator), in the order of their first
    primitive; one part (the operator itself) when it is connected."""
    parent = {p.name: p.name for p in op.primitives}
    linked = set(op.inputs) | {p.output.tensor for p in op.primitives}

    def find(x):
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    seen: dict = {}
    for prim in op.primitives:
        for operand in (*prim.inputs, prim.output):
            if operand.tensor not in linked:
                continue
            other = seen.setdefault(operand.tensor, prim.name)
            parent[find(other)] = find(prim.name)
    roots = list(dict.fromkeys(find(p.name) for p in op.primitives))
    if len(roots) == 1:
        return [Part(op.name, op.cls, tuple(op.primitives), tuple(op.inputs), tuple(op.outputs))]
    result = []
    for root in roots:
        prims = tuple(p for p in op.primitives if find(p.name) == root)
        touched = {o.tensor for p in prims for o in (*p.inputs, p.output)}
        cls = "normalization" if any(p.kind == "reduce" for p in prims) else "elementwise"
        result.append(Part(f"{op.name}_part{len(result)}", cls, prims, tuple(t for t in op.inputs if t in touched),
                           tuple(t for t in op.outputs if t in touched)))
    return result


def rest_part(op, primitives) -> Part | None:
    """The parts of ``op`` that run none of the primitives named in ``primitives``, as one operator
    named ``<op>_rest`` (what is left of ``op`` when another kernel runs those: a GEMM's gradient
    epilogue), or None when nothing is left.  ``primitives`` must be whole parts of ``op``."""
    split = parts(op)
    taken = [part for part in split if {p.name for p in part.primitives} & set(primitives)]
    if {p.name for part in taken for p in part.primitives} != set(primitives):
        raise ValueError(f"{op.name}: {sorted(primitives)} are not whole parts of it")
    left = [part for part in split if part not in taken]
    if not left:
        return None
    prims = tuple(p for part in left for p in part.primitives)
    cls = NORMALIZATION if any(p.kind == "reduce" for p in prims) else ELEMENTWISE
    return Part(f"{op.name}_rest", cls, prims, tuple(t for t in op.inputs if any(t in part.inputs for part in left)),
                tuple(t for t in op.outputs if any(t in part.outputs for part in left)))


def rest_configuration(graph, rest, layouts: dict) -> Configuration:
    """The configuration a gradient epilogue's rest (``rest_part``) runs in: among the
    ``representatives`` of those with the tensors' ``layouts`` ({tensor: layout}, every tensor of
    ``rest`` but its dropout masks), the first whose vector letter is the unit-stride letter of
    its largest tensor (coalesced loads; one part), else the first.  (BERT-large's ``d_b2``, a
    column sum of an 8 MB ``d_ffn``, took about 0.3 ms vectorised along a strided letter.)"""
    found = representatives(configurations(graph, rest, fixed=layouts))
    if not found:
        raise ValueError(f"{rest.name}: no configuration with layouts {layouts}")
    if len(parts(rest)) == 1:
        letters = operator_letters(graph, rest)
        largest = max(layouts, key=lambda t: graph.size(graph.tensors[t].letters))
        unit = letters.tensor_axes[largest][graph.tensors[largest].letters.index(layouts[largest][-1])]
        found = [c for c in found if c.knobs.get("vector") == unit] or found
    return found[0]


def element_operands(graph, prim) -> tuple:
    """The operands of a primitive of a generated kernel as it reads and writes them element-wise,
    with its iteration letters: a shuffle (``dataflow.shuffle``) reads its array under its output's
    letters (the kernel loads it at the moved index) and not its constant; a contraction is refused."""
    if prim.kind != "einsum":
        return (*prim.inputs, prim.output), prim.letters
    if shuffle_of(graph, prim) is None:
        raise ValueError(f"{prim.name}: contraction primitives have no generated kernel here")
    return (*element_inputs(graph, prim), prim.output), prim.output.letters


def operator_letters(graph, op) -> OperatorLetters:
    """Unify the letters of ``op``'s primitives (see ``OperatorLetters``; a shuffle's as
    ``element_operands`` gives them)."""
    classes = UnionFind()
    find, union = classes.find, classes.union

    elements = {prim.name: element_operands(graph, prim) for prim in op.primitives}
    for prim in op.primitives:
        for operand in elements[prim.name][0]:
            for axis, letter in enumerate(operand.letters):
                union(("t", operand.tensor, axis), ("p", prim.name, letter))
    _join_same_names(classes, op, elements)
    externals = list(op.inputs) + list(op.outputs)
    names: dict = {}
    for tensor in externals:  # external tensors name the classes first
        for axis, letter in enumerate(graph.tensors[tensor].letters):
            root = find(("t", tensor, axis))
            if root not in names and letter not in names.values():
                names[root] = letter
    for prim in op.primitives:
        for letter in elements[prim.name][1]:
            root = find(("p", prim.name, letter))
            if root not in names:
                fresh = next(c for c in letter + "abcdefghijklmnopqrstuvwxyz" if c not in names.values())
                names[root] = fresh
    tensor_axes, dims = {}, {}
    for prim in op.primitives:
        for operand in elements[prim.name][0]:
            info = graph.tensors[operand.tensor]
            axes = "".join(names[find(("t", operand.tensor, a))] for a in range(len(info.letters)))
            if len(set(axes)) != len(axes):
                raise ValueError(f"{op.name}: tensor {operand.tensor} is indexed on a diagonal ({axes})")
            tensor_axes[operand.tensor] = axes
            for own, letter in zip(info.letters, axes):
                dims[letter] = graph.letter_dims[own]
    prim_letters = {p.name: {l: names[find(("p", p.name, l))] for l in elements[p.name][1]} for p in op.primitives}
    letters = "".join(dict.fromkeys(l for t in externals for l in tensor_axes[t]))
    letters += "".join(l for l in dict.fromkeys(names.values()) if l not in letters)
    reduced = "".join(dict.fromkeys(prim_letters[p.name][l] for p in op.primitives if p.kind == "reduce"
                                    for l in p.reduced))
    summed = column_sums(op, prim_letters, letters)
    return OperatorLetters(tensor_axes, prim_letters, letters, "".join(l for l in reduced if l not in summed), dims,
                           summed)


def _join_same_names(classes: UnionFind, op, elements: dict) -> None:
    """Join the classes of ``op``'s primitive letters that share a name (one dim) but no tensor
    links, as the grouping into operators and fusion align them (by name: ``dataflow.operators``,
    ``dataflow.fusion._compatible``): two sums over b of two tensors (b, d) run along one reduced
    axis b, not over b and a second axis of the same extent; two maps over (b, d) of two tensors
    read beside one vector over d run over one space (b, d), not (b, d, a).  Classes that one
    tensor or primitive indexes both stay apart (joined, they would be a diagonal).
    ``elements``: {primitive name: ``element_operands``}."""
    find = classes.find
    holders: dict = {}  # class -> the tensors and primitives with an axis in it
    for prim in op.primitives:
        operands, letters = elements[prim.name]
        for letter in letters:
            holders.setdefault(find(("p", prim.name, letter)), set()).add(("p", prim.name))
        for operand in operands:
            for axis in range(len(operand.letters)):
                holders.setdefault(find(("t", operand.tensor, axis)), set()).add(("t", operand.tensor))
    first: dict = {}
    for prim in op.primitives:
        for letter in elements[prim.name][1]:
            kept, other = find(first.setdefault(letter, ("p", prim.name, letter))), find(("p", prim.name, letter))
            if kept != other and not holders[kept] & holders[other]:
                classes.union(kept, other)
                holders[find(kept)] = holders.pop(kept) | holders.pop(other)


def column_sums(op, prim_letters: dict, letters: str) -> str:
    """The letters of an operator's *column sums*, or "": where its reductions run over two
    disjoint letter sets that together are all its letters, and every reduction over one of them
    is a sum nothing inside reads (a layernorm's parameter gradients, a bias gradient, joined to
    the layernorm backward that reads the same tensors: ``column_sum_joins``), the
    tile reduces along the other set's letters (its columns, whole rows per block) and those sums
    run over its rows, each program adding up the rows it visits (``kernels.codegen``)."""
    reduces = [p for p in op.primitives if p.kind == "reduce"]
    sets = {p.name: frozenset(prim_letters[p.name][l] for l in p.reduced) for p in reduces}
    distinct = set(sets.values())
    if len(distinct) != 2:
        return ""
    first, second = distinct
    if first & second or first | second != set(letters):
        return ""
    read = {o.tensor for p in op.primitives for o in p.inputs}
    terminal = [group for group in (first, second) if all(
        p.expr == "sum" and p.output.tensor not in read for p in reduces if sets[p.name] == group)]
    return "".join(l for l in letters if l in terminal[0]) if len(terminal) == 1 else ""


def column_sum_joins(graph, operators) -> list:
    """Operators that join a normalization (a layernorm backward) with its neighbours in
    ``operators`` (the fused graph's order) that only compute column sums over its rows (its
    parameter gradients, a bias gradient of what it writes), where they share a tensor and the
    join has ``column_sums``: one pass instead of one per operator.  Each is named by its
    members joined with "+"; candidates beside the separate operators, which the selection weighs
    (on BERT-large the layernorm backward's data gradient and its parameter gradients each read
    the same two 8 MB tensors)."""
    def tensors(ops) -> set:
        return {t for o in ops for t in (*o.inputs, *o.outputs)}

    result = []
    for k, op in enumerate(operators):
        if op.cls != NORMALIZATION or terminal_reductions(op):
            continue
        first, last, joined = k, k, None
        while True:
            grown = None
            for n in (first - 1, last + 1):
                other = operators[n] if 0 <= n < len(operators) else None
                if other is None or other.cls != NORMALIZATION or other.phase != op.phase \
                        or not terminal_reductions(other) or len(parts(other)) > 1:
                    continue
                members = operators[min(first, n):max(last, n) + 1]
                if not tensors([other]) & tensors(operators[first:last + 1]):
                    continue
                trial = make_operator(graph, [p for m in members for p in m.primitives], op.phase,
                                      name="+".join(m.name for m in members), cls=NORMALIZATION)
                if operator_letters(graph, trial).summed:
                    grown = (min(first, n), max(last, n), trial)
                    break
            if grown is None:
                break
            first, last, joined = grown
        if joined is not None:
            result.append(joined)
    return result


def join_members(join, operators) -> tuple[str, ...]:
    """The names of the operators of ``operators`` that ``join`` (one of ``column_sum_joins``) runs."""
    inside = {p.name for p in join.primitives}
    return tuple(op.name for op in operators if {p.name for p in op.primitives} <= inside)


def generated_operators(graph, operators) -> dict:
    """{name -> operator} of ``operators`` and their joins (``column_sum_joins``): what a plan's
    generated step runs, by the step's name."""
    return {op.name: op for op in [*operators, *column_sum_joins(graph, operators)]}


def tile_axes(letters: OperatorLetters, knobs: dict) -> tuple[str, str, str]:
    """(grid letters, row letters, column letters), each flattened outer -> inner in ``order``."""
    order, vector, red = knobs["order"], knobs["vector"], letters.reduced
    if not red:
        return "", "".join(l for l in order if l != vector), vector
    if vector in red:
        return "", "".join(l for l in order if l not in red), "".join(l for l in order if l in red)
    return "".join(l for l in order if l not in red and l != vector), "".join(l for l in order if l in red), vector


def _next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def _extent(graph, letters: OperatorLetters, group: str) -> int:
    total = 1
    for letter in group:
        total *= graph.dim_values[letters.dims[letter]]
    return total


def terminal_reductions(op) -> bool:
    """Whether ``op`` reduces and no primitive of it reads a reduction's result (bias and
    layernorm-parameter gradients): what mode "split" needs."""
    reduced = {p.output.tensor for p in op.primitives if p.kind == "reduce"}
    return bool(reduced) and not any(o.tensor in reduced for p in op.primitives for o in p.inputs)


def knob_choices(graph, letters: OperatorLetters, vector: str, order: str, exhaustive: bool = False,
                 terminal: bool = False, masked: bool = False) -> list[dict]:
    """Block sizes, mode and num_warps for one (vector, order), pruned by rule 4 of the module doc.
    ``terminal``: the operator's reductions are terminal (``terminal_reductions``), so a reduction
    along the tile's rows may be split over programs (mode "split"); ``masked``: it regenerates a
    dropout mask, so a reduction along the columns also tries every block of ``ROW_CALL_BLOCKS`` rows."""
    grid, rows, cols = tile_axes(letters, {"order": order, "vector": vector})
    n_rows, n_cols = _next_pow2(_extent(graph, letters, rows)), _next_pow2(_extent(graph, letters, cols))
    combos = []  # (mode, block_row, block_col, split or programs)
    # rows per block of a reduction along the tile's columns (with a mask: blocks of one Philox call's rows)
    row_blocks = (1, *ROW_CALL_BLOCKS) if masked else (1, 4, DECISIONS_PER_CALL)
    if not letters.reduced:
        for tile in ELEMENTWISE_TILES:
            for bc in sorted({min(c, n_cols) for c in ELEMENTWISE_COLUMNS}):
                combos.append(("tile", min(max(1, tile // bc), n_rows), bc, 1))
    elif letters.summed:  # whole rows along the columns, column sums over the rows each program visits
        if vector in letters.reduced:
            for pb in sorted({min(b, n_rows) for b in row_blocks}):
                if n_cols * pb <= MAX_TILE:
                    combos += [("row", pb, n_cols, programs) for programs in SUM_PROGRAMS]
    else:
        reduce_rows = vector not in letters.reduced  # the reduction runs along the tile's rows
        n_red, n_par = (n_rows, n_cols) if reduce_rows else (n_cols, n_rows)
        par_blocks = (32, 128) if reduce_rows else row_blocks
        for pb in sorted({min(b, n_par) for b in par_blocks}):
            if n_red * pb <= MAX_TILE:
                combos.append(("row", n_red, pb, 1) if reduce_rows else ("row", pb, n_red, 1))
            for chunk in (256, 1024, 4096) if not reduce_rows else (16, 64):
                if chunk < n_red and chunk * pb <= MAX_TILE:
                    combos.append(("loop", chunk, pb, 1) if reduce_rows else ("loop", pb, chunk, 1))
                    programs = _extent(graph, letters, grid) * -(-_extent(graph, letters, cols) // pb)
                    split = min(_next_pow2(-(-SPLIT_PROGRAMS // programs)), n_red // chunk)
                    if reduce_rows and terminal and split > 1:
                        combos.append(("split", chunk, pb, split))
    result = []
    for mode, br, bc, split in dict.fromkeys(combos):
        extras = [{"split": split}] if mode == "split" else \
            [{"programs": split, "sums_kept": kept} for kept in SUMS_KEPT] if letters.summed else [{}]
        for extra in extras:
            for warps in (1, 2, 4, 8, 16):
                if br * bc >= 4 * 32 * warps or warps == 1 or (exhaustive and warps <= 4):
                    result.append({"vector": vector, "order": order, "mode": mode, "block_row": br, "block_col": bc,
                                   **extra, "num_warps": warps, "dropout": "regenerate"})
    return result


def _restrict(order: str, tensor_letters: str, axes: str) -> str:
    """The layout (in the tensor's own letters) that follows ``order`` of operator letters."""
    own = dict(zip(axes, tensor_letters))
    return "".join(own[l] for l in order if l in own)


def _order_from(graph, letters: OperatorLetters, anchor: str, layout: str, vector: str) -> str:
    """Operator letters in the order of ``anchor``'s layout, then the rest, ``vector`` moved last."""
    own_to_op = dict(zip(graph.tensors[anchor].letters, letters.tensor_axes[anchor]))
    seq = [own_to_op[c] for c in layout] + list(letters.letters)
    return "".join(dict.fromkeys(l for l in seq if l != vector)) + vector


def configurations(graph, op, *, exhaustive: bool = False, fixed: dict | None = None,
                   dropout_choices: tuple = ("regenerate",)) -> list[Configuration]:
    """Every configuration of the non-contraction operator ``op`` at ``graph.dim_values``.

    ``fixed``: {tensor: layout} already decided (shared tensors): only configurations that agree.
    ``dropout_choices``: also weigh loading stored masks with ``("regenerate", "load")``.
    An operator of several parts: rule 5 of the module doc.
    """
    split = parts(op)
    if len(split) > 1:
        return _multipart_configurations(graph, split, exhaustive, fixed or {}, dropout_choices)
    letters = operator_letters(graph, op)
    externals = list(op.inputs) + list(op.outputs)
    fixed = fixed or {}
    has_mask = any(graph.tensors[t].role == "dropout" for t in op.inputs)
    terminal = terminal_reductions(op)
    # letters of size 1 (a batch of one): where they sit changes no address, so they sit outermost
    # (``size_one_first``) and are no vector, unless a fixed layout has them elsewhere
    ones = [l for l in letters.letters if _extent(graph, letters, l) == 1]
    if any(size_one_first(graph, layout) != layout for layout in fixed.values()) or len(ones) == len(letters.letters):
        ones = []
    vectors = [l for l in letters.letters if l not in ones]
    seen, result = set(), []

    def emit(layouts, knobs):
        if any(layouts[t] != fixed[t] for t in fixed if t in layouts):
            return
        for drop in dropout_choices if has_mask else ("regenerate",):
            config = Configuration(dict(layouts), {**knobs, "dropout": drop})
            if config.key() not in seen:
                seen.add(config.key())
                result.append(config)

    for vector in vectors:
        if letters.summed and vector not in letters.reduced:
            continue  # column sums run over the tile's rows, along which nothing else reduces
        others = [l for l in letters.letters if l != vector]
        if exhaustive:
            perms = [[layout for layout in map("".join, itertools.permutations(graph.tensors[t].letters))
                      if not ones or size_one_first(graph, layout) == layout] for t in externals]
            for layouts in itertools.product(*perms):
                layouts = dict(zip(externals, layouts))
                order = _order_from(graph, letters, op.outputs[0], layouts[op.outputs[0]], vector)
                for knobs in knob_choices(graph, letters, vector, order, exhaustive=True, terminal=terminal, masked=has_mask):
                    emit(layouts, knobs)
        else:
            outermost = [l for l in others if l in ones]
            for outer in itertools.permutations(others):
                if list(outer[:len(outermost)]) != outermost:
                    continue
                order = "".join(outer) + vector
                layouts = {t: _restrict(order, graph.tensors[t].letters, letters.tensor_axes[t]) for t in externals}
                for knobs in knob_choices(graph, letters, vector, order, terminal=terminal, masked=has_mask):
                    emit(layouts, knobs)
    return result


def size_one_first(graph, layout: str) -> str:
    """``layout`` with its letters of size 1 moved outermost (in their order): the same addresses,
    the name ``configurations`` gives them (a GEMM may store a batch of one anywhere); a layout
    already so named is its own."""
    return "".join(sorted(layout, key=lambda letter: graph.size(letter) != 1))


def combine_parts(configs: list[Configuration], num_warps: int, dropout: str) -> Configuration:
    """One multi-part configuration from one configuration per part (in ``parts`` order)."""
    layouts = {t: l for c in configs for t, l in c.layouts.items()}
    own = tuple({k: v for k, v in c.knobs.items() if k not in ("num_warps", "dropout")} for c in configs)
    return Configuration(layouts, {"parts": own, "num_warps": num_warps, "dropout": dropout})


def _multipart_configurations(graph, split: list[Part], exhaustive: bool, fixed: dict,
                              dropout_choices: tuple) -> list[Configuration]:
    defaults = [default_configuration(graph, part) for part in split]
    has_mask = any(graph.tensors[t].role == "dropout" for part in split for t in part.inputs)
    seen, result = set(), []
    base = combine_parts(defaults, 4, "regenerate")  # what ``composed`` prices the parts against
    if all(base.layouts[t] == fixed[t] for t in fixed if t in base.layouts):
        seen.add(base.key())
        result.append(base)
    for k, part in enumerate(split):
        for config in configurations(graph, part, exhaustive=exhaustive, fixed=fixed):
            chosen = defaults[:k] + [config] + defaults[k + 1:]
            if any(c.layouts[t] != fixed[t] for c in chosen for t in fixed if t in c.layouts):
                continue
            for drop in dropout_choices if has_mask else ("regenerate",):
                combined = combine_parts(chosen, config.knobs["num_warps"], drop)
                if combined.key() not in seen:
                    seen.add(combined.key())
                    result.append(combined)
    return result


def default_configuration(graph, op) -> Configuration:
    """Spec-order layouts; vector = the innermost spec letter of the first full-space tensor that
    is reduced (normalization) or of the first output (element-wise); mid-sized knobs.  Several
    parts: each part's default, 4 warps."""
    split = parts(op)
    if len(split) > 1:
        return combine_parts([default_configuration(graph, part) for part in split], 4, "regenerate")
    letters = operator_letters(graph, op)
    externals = list(op.inputs) + list(op.outputs)
    layouts = {t: graph.tensors[t].letters for t in externals}
    full = next(t for t in externals if set(letters.tensor_axes[t]) == set(letters.letters)) \
        if any(set(letters.tensor_axes[t]) == set(letters.letters) for t in externals) else externals[0]
    axes = letters.tensor_axes[full]
    vector = next((l for l in reversed(axes) if l in letters.reduced), axes[-1]) if letters.reduced else axes[-1]
    order = "".join(l for l in axes if l != vector) + "".join(l for l in letters.letters if l not in axes) + vector
    choices = knob_choices(graph, letters, vector, order, terminal=terminal_reductions(op))
    preferred = [k for k in choices if _plain_knobs(k, k["num_warps"])] or choices
    return Configuration(layouts, preferred[len(preferred) // 2])


def access_pattern(config: Configuration) -> str:
    """The part of ``config`` that decides which addresses a tile touches: the tensors' layouts and
    (per part) the vector letter and letter order.  Configurations with the same pattern differ
    only in tile sizes, mode, warps and the dropout source (the *knobs* of a two-stage search)."""
    parts_knobs = _each_part(config)
    layouts = ",".join(f"{t}:{config.layouts[t]}" for t in sorted(config.layouts))
    return layouts + "|" + ";".join(f"{k['vector']}/{k['order']}" for k in parts_knobs)


def representatives(configs: list[Configuration], prefer=None) -> list[Configuration]:
    """One configuration per ``access_pattern`` of ``configs`` (first-seen order): among those
    in ``PLAIN_MODES`` with 4 warps and tiles of at most ``PLAIN_TILE`` (else all), and of those
    the ones the rule ``prefer`` accepts where it accepts any (``masks_grouped``: drawing every
    regenerated dropout mask sixteen decisions per Philox call), the middle one, as in
    ``default_configuration``: the first stage of a two-stage search measures these.  (A tile whose
    block misses the 64-decision groups draws once per element, four to sixteen times the Philox work:
    BERT-large's bias + ReLU + dropout over ubj ran 0.20 ms so against 0.06 over bju.)"""
    groups: dict[str, list[Configuration]] = {}
    for config in configs:
        groups.setdefault(access_pattern(config), []).append(config)
    chosen = []
    for group in groups.values():
        varied = _varied_parts(group)
        preferred = [c for c in group if _plain(c, varied)] or group
        if prefer is not None:
            preferred = [c for c in preferred if prefer(c)] or preferred
        chosen.append(preferred[len(preferred) // 2])
    return chosen


def masks_grouped(graph, op):
    """The rule, for ``representatives``, whether a configuration of ``op`` draws every dropout mask
    it regenerates in groups along its tile's columns or rows (``grouped_masks``; a multi-part
    configuration counts as grouped).  The operator's letters are found once, at the first
    one-part configuration, not per configuration."""
    masks = tuple(t for t in op.inputs if graph.tensors[t].role == "dropout")
    letters = functools.cache(lambda: operator_letters(graph, op))

    def rule(config: Configuration) -> bool:
        if "parts" in config.knobs:
            return True
        _, rows, cols = tile_axes(letters(), config.knobs)
        grouped = grouped_masks(graph, letters(), cols, masks, config.knobs["block_col"]) \
            + grouped_masks(graph, letters(), rows, masks, config.knobs["block_row"])
        return set(grouped) == set(masks)
    return rule


def grouped_masks(graph, letters: OperatorLetters, axis: str, regenerated: tuple, block: int) -> tuple:
    """The masks of ``regenerated`` whose decisions can come sixteen per Philox call along one tile
    axis (its letters ``axis``, its block ``block``): those letters are the mask's trailing letters in
    spec order (element c along the axis is logical index ``base + c``), their extent is a multiple of
    64 (so is every other logical stride: each base starts a group of 64 counters,
    ``dataflow.dropout_mask``) and so is ``block`` (each block is whole groups)."""
    extent = 1
    for letter in axis:
        extent *= graph.dim_values[letters.dims[letter]]
    if not axis or extent % DECISION_GROUP or block % DECISION_GROUP:
        return ()
    return tuple(t for t in regenerated if letters.tensor_axes[t].endswith(axis))


def _plain_knobs(knobs: dict, num_warps: int) -> bool:
    return knobs["mode"] in PLAIN_MODES and num_warps == 4 and knobs["block_row"] * knobs["block_col"] <= PLAIN_TILE


def _each_part(config: Configuration) -> tuple:
    """The knobs of each part of ``config`` (one part: its own knobs)."""
    return config.knobs["parts"] if "parts" in config.knobs else (config.knobs,)


def _varied_parts(group: list[Configuration]) -> list[int] | None:
    """The parts whose knobs differ within ``group`` (one access pattern of a multi-part space: the
    part varied there; the others sit at their defaults, whatever mode those are), None for one."""
    if len(group) < 2 or "parts" not in group[0].knobs:
        return None
    return [k for k in range(len(group[0].knobs["parts"]))
            if len({repr(sorted(c.knobs["parts"][k].items())) for c in group}) > 1] or None


def _plain(config: Configuration, varied: list[int] | None = None) -> bool:
    """Whether ``config`` (its ``varied`` parts; None: all) is a plain one: ``PLAIN_MODES``, 4
    warps, a tile of at most ``PLAIN_TILE``, the mask regenerated.  (BERT-large's joined bias
    gradients at B=96 L=128: the joined part's default loops, so with every part judged no variation
    was plain, and the first stage measured ``d_b2``'s part over bji looping over all 12288 rows:
    480 us, where a split one takes a few.)"""
    knobs = _each_part(config)
    judged = range(len(knobs)) if varied is None else varied
    return all(_plain_knobs(knobs[k], config.knobs["num_warps"]) for k in judged) \
        and config.knobs.get("dropout", "regenerate") == "regenerate"
