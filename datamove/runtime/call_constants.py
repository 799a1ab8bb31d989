"""A layer's constants over its call dims, read at a call's sizes.

A constant over a dim of the activations (a decoder's sequence length T: GPT-2's causal mask
``causal`` [T, T], Llama's rotary tables ``cos`` / ``sin`` [T, E] and its ``np.triu`` mask) lets a
call choose that dim (``datamove.runtime.shapes.call_dims``) only where its values at any size are
known to be right (``following_calls``):

- ``KNOWN``: a constant the graph gives its value (``dataflow.initial_values``: a causal mask by
  structure, a constant the front end made of ``np.triu`` / ``np.concatenate`` / ...): at a call's
  sizes it is that value at those sizes, shorter or longer than the layer holds (a causal mask at
  T' is the causal mask at T', the leading [T', T'] block of the one at T);
- ``LEADING``: a constant the spec names in ``POSITION_TABLES`` (the interface's ``positions``):
  its entries along the call dim are the positions 0, 1, ... (RoPE's tables for positions 0..T-1,
  as the user's ``set_constant`` or HF's model filled them), so a call at T' <= T reads its leading
  T' entries; a longer call has nothing to read and is refused (``TunedLayer``, one line).

Any other constant over a dim keeps that dim fixed: the layer runs at the size it holds.

``ConstantsAtCall`` is what a program at a call's sizes (``LayerProgram``, ``TorchProgram``) does of
them, where its sizes differ from those the layer holds the constants at (``held``): the known
values made once with the program, the leading entries of the held tensor taken on each call (a
view where it is already stored densely in the plan's layout, as a table over (s, e) is; else a
copy into it: the generated kernels read a tensor at the strides of its layout).  At the sizes the
layer holds (its tuned shape) a program has none of them: the call reads the held tensors as
before.
"""
from __future__ import annotations

import torch

from datamove.dataflow.initial_values import CausalMask, KnownValue, initial_values
from datamove.kernels.codegen import allocate
from datamove.kernels.launcher import stored_alike

KNOWN, LEADING = "known", "leading"


def following_calls(graph, interface, kinds: dict | None = None) -> dict[str, str]:
    """{constant -> ``KNOWN`` | ``LEADING``}: the constants whose values at a call's sizes are known
    (module doc); the others fix the dims they are over.  ``kinds``: the constants'
    ``initial_values``, where the caller has them."""
    kinds = initial_values(graph, (), interface.constants) if kinds is None else kinds
    result = {t: KNOWN for t, kind in kinds.items() if isinstance(kind, (CausalMask, KnownValue))}
    result.update({t: LEADING for t in interface.positions})
    return result


class ConstantsAtCall:
    """The constants a program over ``graph`` (at a call's sizes) reads otherwise than the layer
    holds them (at ``held``: {dim -> size}; None: at ``graph``'s own sizes): ``known`` {name ->
    its value at the call's sizes, spec order, stored in ``layouts`` where ``dense``}, ``leading``
    {name -> the sizes of its leading entries read, spec order}; ``held``: ``graph`` at the sizes
    the layer holds its constants at (what FSDP2's static copies hold).  ``dense``: the program's steps read a
    constant at its layout's strides (the kernels); else any strides (the torch backend).
    ``unread``: constants the program's steps never load (a causal mask the fused attention applies
    itself): left as held, no value made (GPT-2's [T', T'] mask, one per program)."""

    def __init__(self, graph, interface, held: dict | None, layouts: dict, dtype: torch.dtype, device, dense: bool,
                 unread: tuple[str, ...] | list[str] = ()):
        self.graph, self.layouts, self.dtype, self.device, self.dense = graph, layouts, dtype, device, dense
        self.known: dict[str, torch.Tensor] = {}
        self.leading: dict[str, tuple[int, ...]] = {}  # name -> the sizes read (spec order)
        self._index: dict[str, tuple[slice, ...]] = {}
        self._strides: dict[str, tuple] = {}
        spanned = {graph.letter_dims[x] for t in interface.constants for x in graph.tensors[t].letters}
        resized = {d for d in spanned if (held or {}).get(d, graph.dim_values[d]) != graph.dim_values[d]}
        self.held = graph.with_dims({**graph.dim_values, **held}) if resized else graph
        if not resized:
            return
        kinds = initial_values(graph, (), interface.constants)
        for t, how in following_calls(graph, interface, kinds).items():
            letters = graph.tensors[t].letters
            if t in unread or not {graph.letter_dims[x] for x in letters} & resized:
                continue
            if how == KNOWN:
                value = torch.from_numpy(kinds[t].array(graph, t)).to(dtype)
                self.known[t] = self._stored(t).copy_(value) if dense else value.to(device)
            else:
                self.leading[t] = tuple(graph.size(x) for x in letters)
                self._index[t] = tuple(slice(0, n) for n in self.leading[t])
                self._strides[t] = allocate(graph, t, layouts[t], dtype, "meta").stride()

    def __bool__(self) -> bool:
        return bool(self.known or self.leading)

    def _stored(self, t: str) -> torch.Tensor:
        return allocate(self.graph, t, self.layouts[t], self.dtype, self.device)

    def take(self, store: dict) -> dict:
        """``store`` (the program's inputs, spec order; the constants as the layer holds them) with
        these constants at the call's sizes."""
        store.update(self.known)
        for t, index in self._index.items():
            view = store[t][index]
            store[t] = view if not self.dense or stored_alike(view, self._strides[t]) else self._stored(t).copy_(view)
        return store
