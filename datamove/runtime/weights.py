"""Weights in and out: a PyTorch module's state dict <-> the tuned layer's parameters.

A spec names, per PyTorch module type, where each of its parameters lives (the spec's
``WEIGHTS``): ``(key, pattern, index)``, where ``pattern`` lists the key's dims as the spec's
letters, a parenthesised group merging letters into one dim ("(h p) i": a [H*P, N] matrix, h
outer) and a leading count stacking several tensors in one dim ("(3 h p) i": PyTorch's
``in_proj_weight``, Q/K/V stacked), ``index`` picking one of the stack (else None).
"""
from __future__ import annotations

import re

import torch

_GROUP = re.compile(r"\(([^)]*)\)|(\S)")


def parse_pattern(pattern: str) -> list[tuple[int, str]]:
    """Dims of a pattern as (stack count, letters): "(3 h p) i" -> [(3, "hp"), (1, "i")]."""
    dims = []
    for group, single in _GROUP.findall(pattern):
        words = group.split() if group else [single]
        count = int(words[0]) if words[0].isdigit() else 1
        dims.append((count, "".join(w for w in words if not w.isdigit())))
    return dims


def _split(pattern: str, sizes: dict[str, int]) -> tuple[list[int], str, list[int]]:
    """(unmerged shape, its letters, merged shape) of a pattern; a stack count stays its own dim."""
    shape, letters, merged = [], "", []
    for count, group in parse_pattern(pattern):
        if count > 1:
            shape.append(count)
            letters += "#"
        shape += [sizes[x] for x in group]
        letters += group
        total = count
        for x in group:
            total *= sizes[x]
        merged.append(total)
    return shape, letters, merged


def to_spec(value: torch.Tensor, pattern: str, index: int | None, letters: str, sizes: dict[str, int]) -> torch.Tensor:
    """A PyTorch tensor in ``pattern`` (stack member ``index``) as a tensor over ``letters`` (spec order)."""
    shape, own, merged = _split(pattern, sizes)
    if tuple(value.shape) != tuple(merged):
        raise ValueError(f"weight of shape {tuple(value.shape)} does not match {pattern!r} = {tuple(merged)}")
    value = value.reshape(shape)
    if "#" in own:
        value = value.select(own.index("#"), index)
        own = own.replace("#", "")
    return value.permute([own.index(x) for x in letters])


def from_spec(value: torch.Tensor, pattern: str, index: int | None, letters: str, sizes: dict[str, int],
              into: torch.Tensor | None = None) -> torch.Tensor:
    """The inverse of ``to_spec``: ``value`` over ``letters`` written into (a new or the given)
    PyTorch tensor of ``pattern``'s shape, as stack member ``index``."""
    shape, own, merged = _split(pattern, sizes)
    target = torch.empty(merged, dtype=value.dtype, device=value.device) if into is None else into
    view = target.view(shape)
    if "#" in own:
        view = view.select(own.index("#"), index)
        own = own.replace("#", "")
    view.copy_(value.permute([letters.index(x) for x in own]))
    return target


def module_kind(module: torch.nn.Module) -> str:
    """``"transformers.BertLayer"``-style name of a module's type (top package and class)."""
    return f"{type(module).__module__.split('.')[0]}.{type(module).__name__}"
