"""The shapes an exported layer runs at: which dims a call may size, which tuned plan runs it, and
that plan fitted to the call's sizes.

*Call dims* (``call_dims``): the dims of the activations' letters that no parameter carries, nor
a constant whose values at other sizes are not known (``runtime.call_constants``: a causal mask or
another constant of known value is known at any size, a position table declared in the spec's
``POSITION_TABLES`` at any size up to the one the layer holds).  BERT: B and L (x is [B, L, N]; N,
H, P, U are fixed by the weights); GPT-2: B and T (its causal mask [T, T] is known at any T);
Llama: B and T (its causal mask, and its rotary tables ``cos`` / ``sin`` [T, E] as position tables:
a call's T at most the layer's).  A call's *shape* is {call dim -> size} read off its activations
(``call_shape``), every size >= 1.

An artifact holds one plan per tuned shape.  A call at a tuned shape runs that plan as chosen; any
other runs the *nearest* tuned plan (``nearest``): the one whose element count (the product of the
call dims: tokens for BERT) is the smallest at least as large as the call's, or, where every tuned
shape is smaller, the largest; ties go to the closest sizes dim by dim (sum of |log ratio|), then to
the order of the artifact.  Its kernels run at the call's sizes (``fit_plan``): every kernel takes
its sizes as runtime arguments and masks ragged edges, so a step's configuration carries over
except where a knob depends on the sizes, which ``fit_plan`` adjusts:

- a generated normalization in mode "row" holds a whole reduction row in one tile: where the row
  grew past its block, the block grows to cover it (a power of two) if the tile stays within
  ``layouts.space.MAX_TILE``, else the mode becomes "loop" over chunks (same parallel block);
- the attention backward reading the dropout decisions the forward saved (``dropout_mask="saved"``)
  needs the mask drawn in whole Philox groups (``kernels.attention.dropout_grouped``); where the
  new sizes do not allow it the backward regenerates the mask instead;
- a Triton GEMM reading its operands through tensor descriptors (``tma``) needs every stride a
  multiple of 16 bytes; where the new sizes break that it reads them plainly (same tiles);
- a cuBLAS GEMM's ``algorithm`` is an index into cuBLASLt's heuristic's list at the tuned sizes,
  which at other sizes names another kernel: it is dropped (PyTorch's call, the list's first).
"""
from __future__ import annotations

import math
import operator
from dataclasses import replace

from datamove.dataflow.executor import dropout_offsets
from datamove.kernels.attention import dropout_grouped, dropout_strides_for
from datamove.kernels.contraction import row_major_strides
from datamove.layouts.plan import ATTENTION_BACKWARD, GEMM, GEMM_EPILOGUE, GENERATED, Plan, Step
from datamove.layouts.space import MAX_TILE, generated_operators, operator_letters, parts, tile_axes
from datamove.layouts.step_config import AttentionConfig
from datamove.runtime.call_constants import following_calls

LOOP_CHUNKS = {True: (16, 64), False: (256, 1024, 4096)}  # mode "loop" chunks (reduction along rows?) as in knob_choices


def call_dims(graph, interface) -> tuple[str, ...]:
    """The dims a call may size: those of the activations' letters (in their PyTorch order) that no
    parameter carries, nor a constant whose values at other sizes are not known (module doc)."""
    fixed = {graph.letter_dims[letter] for t in _fixing(graph, interface) for letter in graph.tensors[t].letters}
    dims = (graph.letter_dims[letter] for t in interface.activations for letter in interface.torch_order[t])
    return tuple(dict.fromkeys(d for d in dims if d not in fixed))


def _fixing(graph, interface) -> list[str]:
    """The parameters, then the constants whose values at other sizes are not known: what fixes the
    sizes of the dims it is over."""
    following = following_calls(graph, interface)
    return [*interface.parameters, *(t for t in interface.constants if t not in following)]


def held_graph(graph, interface, tuned: list[dict]):
    """``graph`` at the sizes a layer holds its constants at: each call dim a constant is over (a
    decoder's T) at its largest size among the ``tuned`` shapes ({call dim -> size}: a position table
    then holds the positions of every tuned length), every other dim as in ``graph``."""
    spanned = {graph.letter_dims[letter] for t in interface.constants for letter in graph.tensors[t].letters}
    largest = {d: max(shape[d] for shape in tuned) for d in tuned[0] if d in spanned}
    if all(graph.dim_values[d] == size for d, size in largest.items()):
        return graph
    return graph.with_dims({**graph.dim_values, **largest})


def position_limits(graph, interface, dims: tuple[str, ...]) -> dict[str, tuple[int, list[str]]]:
    """{call dim -> (its size in ``graph``, the position tables over it)}: a call along it reads the
    tables' leading entries, so it may be no longer (``call_shape``'s ``limits``); ``graph``: at the
    sizes the layer holds its constants at."""
    limits: dict[str, tuple[int, list[str]]] = {}
    for t in interface.positions:
        for dim in dict.fromkeys(graph.letter_dims[letter] for letter in graph.tensors[t].letters):
            if dim in dims:
                limits.setdefault(dim, (graph.dim_values[dim], []))[1].append(t)
    return limits


def shape_key(shape: dict) -> tuple:
    """A hashable key of a shape {dim -> size}."""
    return tuple(sorted(shape.items()))


def describe(shape: dict) -> str:
    """``B=3, L=23``."""
    return ", ".join(f"{dim}={size}" for dim, size in shape.items())


def _holder(graph, interface, dim: str) -> str:
    """The first parameter or constant over ``dim`` that fixes its size (``_fixing``)."""
    return next(t for t in _fixing(graph, interface)
                if any(graph.letter_dims[letter] == dim for letter in graph.tensors[t].letters))


def sized_by(graph, interface, dim: str) -> str:
    """What fixes ``dim`` for a layer: ``the weight ln1_gain`` or ``the constant alibi`` (``_holder``)."""
    holder = _holder(graph, interface, dim)
    return f"the {'weight' if holder in interface.parameters else 'constant'} {holder}"


def call_shape(graph, interface, dims: tuple[str, ...], activations, limits: dict | None = None) -> dict[str, int]:
    """The shape {call dim -> size} of a call on ``activations`` (PyTorch order); refuses a tensor
    with another number of dims, a fixed dim of another size, a call dim below 1 or above its
    ``limits`` (``position_limits``), or two activations that disagree on a call dim, naming the
    expected shape.  Sizes are read with ``operator.index``: under ``torch.compile`` a symbolic size
    becomes the call's own (a guard), as a call's program is made for its sizes."""
    shape: dict[str, int] = {}
    for t, x in zip(interface.activations, activations):
        order = interface.torch_order[t]
        expected = tuple(graph.letter_dims[letter] if graph.letter_dims[letter] in dims
                         else graph.size(letter) for letter in order)
        if not hasattr(x, "shape"):
            raise TypeError(f"{t}: expected a torch.Tensor, got {type(x).__name__}")
        if len(x.shape) != len(order) or any(isinstance(e, int) and operator.index(s) != e for s, e in zip(x.shape, expected)):
            fixed = ", ".join(f"{dim} by {_holder(graph, interface, dim)}" for dim in
                              dict.fromkeys(graph.letter_dims[letter] for letter in order) if dim not in dims)
            raise ValueError(f"{t}: shape {tuple(x.shape)}, {_expected(expected, order, dims)}; the other sizes are "
                             f"fixed by the layer's tensors ({fixed})" + _padded_length(graph, interface, dims, order, x.shape))
        for letter, size in zip(order, x.shape):
            dim, size = graph.letter_dims[letter], operator.index(size)
            if dim not in dims:
                continue
            if size < 1:
                raise ValueError(f"{t}: shape {tuple(x.shape)}, {_expected(expected, order, dims)}")
            if shape.setdefault(dim, size) != size:
                raise ValueError(f"{t}: {dim}={size} along {letter}, but {dim}={shape[dim]} elsewhere in the call")
            if limits and dim in limits and size > limits[dim][0]:
                held, tables = limits[dim]
                raise ValueError(f"{t}: {dim}={size}, longer than the {held} positions of the layer's position tables "
                                 f"({', '.join(tables)}, for positions 0..{held - 1}): truncate to {dim}={held}, or tune "
                                 f"the layer at your longest length (optimize-layer --dims {dim}=...), which runs every "
                                 "shorter one (docs/runtime.md, Variable lengths)")
    return shape


def _padded_length(graph, interface, dims: tuple[str, ...], order: str, shape) -> str:
    """What to do where ``shape`` (over ``order``) differs from the layer along a dim that only
    constants of values unknown at other sizes fix (a decoder's sequence length under a constant
    table not declared a position table), or '' (a call of another number of dims, or a dim a
    parameter sizes: another model); ``dims``: the call dims (any size)."""
    if len(shape) != len(order):
        return ""
    weighted = {graph.letter_dims[letter] for t in interface.parameters for letter in graph.tensors[t].letters}
    off = [(graph.letter_dims[letter], size) for letter, size in zip(order, shape)
           if graph.letter_dims[letter] not in weighted | set(dims) and operator.index(size) != graph.size(letter)]
    if not off:
        return ""
    dim, size = off[0]
    tuned, holder = graph.dim_values[dim], _holder(graph, interface, dim)
    pad = (f"with a key_padding_mask of the padding (a HF model: its attention_mask; the tokenizer or "
           f"DataCollatorWithPadding with padding='max_length', max_length=")
    fixed = (f"; {dim} is the sequence length the layer was tuned at ({holder} is a constant over it whose values at "
             f"other lengths the layer cannot know; if its entries along {dim} are positions 0, 1, ..., name it in "
             f"the spec's POSITION_TABLES and run optimize-layer again: any shorter {dim} then runs): ")
    if operator.index(size) < tuned:
        return f"{fixed}pad every batch to {dim}={tuned} {pad}{tuned}; docs/runtime.md, Variable lengths)"
    return (f"{fixed}truncate to {dim}={tuned}, or tune the layer at your longest length (optimize-layer --dims "
            f"{dim}=...) and pad every batch to it {pad}that length; docs/runtime.md, Variable lengths)")


def _expected(expected: tuple, order: str, dims: tuple[str, ...]) -> str:
    """``call_shape``'s refusal: the expected shape (call dims by name) and its letters; made only
    when a call is refused (every call passes through ``call_shape``)."""
    return f"expected ({', '.join(map(str, expected))}) ({', '.join(order)}): {', '.join(dims)} any size >= 1"


def nearest(tuned: list[dict], shape: dict) -> int:
    """The index in ``tuned`` (shapes {call dim -> size}) of the plan a call at ``shape`` runs: the
    module doc's rule (``shape`` itself where it is tuned)."""
    wanted = math.prod(shape.values())

    def rank(n: int):
        have = math.prod(tuned[n][d] for d in shape)
        return (have < wanted, abs(math.log(have / wanted)),
                sum(abs(math.log(tuned[n][d] / shape[d])) for d in shape), n)
    return min(range(len(tuned)), key=rank)


def fit_plan(plan: Plan, graph, operators, itemsize: int) -> Plan:
    """``plan`` to run at ``graph``'s dims (module doc): the same steps, layouts and kernels, the
    knobs that depend on sizes adjusted; ``itemsize``: bytes per element of the layer's dtype."""
    ops = generated_operators(graph, operators)
    steps = [_fitted(step, plan, graph, ops, itemsize) for step in plan.steps]
    return replace(plan, dims=dict(graph.dim_values), steps=steps)


def _fitted(step: Step, plan: Plan, graph, ops: dict, itemsize: int) -> Step:
    config = step.config
    if step.kind == GENERATED:
        op, knobs = ops[step.name], config.knobs
        if "parts" in knobs:
            fitted = [_row_fitted(graph, part, own) for part, own in zip(parts(op), knobs["parts"])]
            knobs = {**knobs, "parts": type(knobs["parts"])(fitted)}
        else:
            knobs = _row_fitted(graph, op, knobs)
        return replace(step, config=replace(config, knobs=knobs))
    if step.kind == ATTENTION_BACKWARD and config.knobs.get("dropout_mask") == "saved" \
            and not _attention_grouped(graph, config):
        return replace(step, config=replace(config, knobs={**config.knobs, "dropout_mask": "regenerate"}))
    if step.kind == GEMM and config.algorithm and dict(graph.dim_values) != dict(plan.dims):
        return replace(step, config=replace(config, algorithm=0))
    if step.kind in (GEMM, GEMM_EPILOGUE) and (config.gemm or {}).get("tma"):
        operands = [config.operands["a"], config.operands["b"]]
        if not all(_descriptor_strides(graph, members, step.reads.get(t) or plan.layouts[t], itemsize)
                   for members in operands for t in members):
            return replace(step, config=replace(config, gemm={**config.gemm, "tma": False}))
    return step


def _row_fitted(graph, op, knobs: dict) -> dict:
    """One part's knobs with a mode "row" tile covering its whole reduction row at ``graph``'s dims."""
    if knobs["mode"] != "row":
        return knobs
    letters = operator_letters(graph, op)
    _, rows, cols = tile_axes(letters, knobs)
    along_rows = knobs["vector"] not in letters.reduced
    reduced, parallel = ("block_row", "block_col") if along_rows else ("block_col", "block_row")
    extent = math.prod(graph.dim_values[letters.dims[letter]] for letter in (rows if along_rows else cols))
    if knobs[reduced] >= extent:
        return knobs
    block = 1 << (extent - 1).bit_length()  # a power of two
    if block * knobs[parallel] <= MAX_TILE:
        return {**knobs, reduced: block}
    if letters.summed:  # column sums need whole rows: fewer of them per block
        if block > MAX_TILE:
            raise ValueError(f"{op.name}: rows of {extent} do not fit one block of at most {MAX_TILE} elements, "
                             "which its column sums need")
        return {**knobs, reduced: block, parallel: MAX_TILE // block}
    chunk = max((c for c in LOOP_CHUNKS[along_rows] if c * knobs[parallel] <= MAX_TILE), default=LOOP_CHUNKS[along_rows][0])
    return {**knobs, "mode": "loop", reduced: chunk}


def _attention_grouped(graph, config: AttentionConfig) -> bool:
    """Whether the attention's dropout mask is drawn in whole Philox groups at ``graph``'s dims."""
    mask = config.roles.get("mask")
    if not mask:
        return True
    letters = config.letters
    rename = {letters["batch"]: "b", letters["heads"]: "h", letters["rows"]: "j", letters["keys"]: "k"}
    order = "".join(rename[x] for x in graph.tensors[mask].letters)
    sizes = [graph.size(letters[role]) for role in ("batch", "heads", "rows", "keys")]
    return dropout_grouped(dropout_strides_for(order, *sizes), dropout_offsets(graph)[mask])


def _descriptor_strides(graph, members: list[str], layout: str, itemsize: int) -> bool:
    """Whether every stride of ``members`` stored densely in ``layout`` (and the distance between
    stacked members) is a multiple of 16 bytes, as tensor descriptors need (a sufficient test)."""
    sizes = {letter: graph.size(letter) for letter in layout}
    strides = [s for letter, s in row_major_strides(layout, sizes).items() if sizes[letter] > 1 and s > 1]
    if len(members) > 1:
        strides.append(math.prod(sizes.values()))
    return all(s * itemsize % 16 == 0 for s in strides)


def check_plans(plans: list[Plan], graph, interface) -> None:
    """Refuse plans that cannot share one layer's weights: two at one shape, dims other than the
    call dims that differ from the first plan's, or parameters and constants stored in other
    layouts than the first plan stores them (``ValueError`` naming them)."""
    dims = call_dims(graph, interface)
    first, seen = plans[0], set()
    stored = interface.parameters + interface.constants
    for plan in plans:
        shape = describe({d: plan.dims[d] for d in dims})
        fixed = {d: v for d, v in plan.dims.items() if d not in dims and first.dims.get(d) != v}
        if fixed:
            raise ValueError(f"the plan at {shape} has {describe(fixed)}, the first {describe({d: first.dims.get(d) for d in fixed})}: "
                             f"only {', '.join(dims)} may differ between the shapes of one layer (the others size its weights)")
        if shape in seen:
            raise ValueError(f"two plans tuned at {shape}")
        seen.add(shape)
        moved = [t for t in stored if plan.layouts[t] != first.layouts[t]]
        if moved:
            raise ValueError(f"the plan at {shape} stores {', '.join(moved)} in another layout than the first plan: "
                             f"the plans of one layer share its parameters (optimize-layer fixes them)")


def file_stem(shape: dict) -> str:
    """A file name for a shape: ``B8-L256``."""
    return "-".join(f"{dim}{size}" for dim, size in shape.items())
