"""The layer's precision as one object, from the command line to the kernels.

``Precision`` holds every spelling of one dtype: ``name`` ("bfloat16", the stored form: ``plan.json``,
``manifest.json``, ``report.json``, the tuning database's keys, the cost model's figures), ``short``
("bf16", the command line's ``--dtype`` and the output folder's name), ``torch``
(``torch.bfloat16``, what the kernels and the tuning's tensors are made in) and ``itemsize`` (bytes
per element).  ``parse`` takes any of them (or a ``Precision``) and gives the one object; anything
else is refused in one line.  ``str()`` of a precision is its ``name``, so a message or a path
written with it reads as the stored string did.

Imports nothing of ``datamove`` and not torch (``torch`` is looked up when asked for), so every
stage may import it.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass


@dataclass(frozen=True)
class Precision:
    """One dtype of a layer: ``name`` (stored), ``short`` (command line), ``itemsize`` (bytes);
    ``torch``: the torch dtype."""

    name: str
    short: str
    itemsize: int

    @property
    def torch(self):
        import torch

        return getattr(torch, self.name)

    def __str__(self) -> str:
        return self.name


BF16 = Precision("bfloat16", "bf16", 2)
FP16 = Precision("float16", "fp16", 2)
FP32 = Precision("float32", "fp32", 4)
PRECISIONS = (BF16, FP16, FP32)
_BY_TEXT = {text: p for p in PRECISIONS for text in (p.name, p.short)}


def parse(value) -> Precision:
    """The ``Precision`` of ``value``: a ``Precision``, a name ("bfloat16"), a short name ("bf16")
    or a torch dtype (``torch.bfloat16``); anything else is a ``ValueError`` of one line naming
    what is accepted."""
    if isinstance(value, Precision):
        return value
    if isinstance(value, str) and value in _BY_TEXT:
        return _BY_TEXT[value]
    torch = sys.modules.get("torch")  # a torch dtype exists only where torch was imported
    if torch is not None and isinstance(value, torch.dtype):
        for precision in PRECISIONS:
            if precision.torch == value:
                return precision
    accepted = ", ".join(f"{p.short} / {p.name} / torch.{p.name}" for p in PRECISIONS)
    raise ValueError(f"unknown dtype {value!r}: expected one of {accepted}")
