"""What every launcher of a plan's steps stands on: the store's names, the per-call values, the
allocation of tensors in their plan layouts and the ``Launcher`` base.

A *store* is a dict {tensor name -> torch tensor}: every tensor is held with its dims in its spec
letter order (``graph.tensors[t].letters``) and stored densely in its plan layout (strides say
which; ``kernels.codegen.allocate``).  A copy of ``t`` in another layout (made by a
``LAYOUT_CHANGE`` step) is held under ``copy_name(t, layout)``.

This module sits below both the runtime's step kinds (``datamove.runtime.steps``: generated kernels,
GEMMs, layout changes) and the kernel families with launchers of their own
(``datamove.families``: the fused attention), so that a family's launcher subclasses ``Launcher``
and ``steps.build_launcher`` builds it from the family's table without the family importing
``datamove.runtime.steps``.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from datamove.kernels.codegen import allocate
from datamove.kernels.launch import hooked, recording
from datamove.kernels.replay import StepReplay
from datamove.layouts.plan import Step


def copy_name(tensor: str, layout: str) -> str:
    """Where a store holds the copy of ``tensor`` in ``layout`` that a layout change made."""
    return f"{tensor}@{layout}"


def copied_tensor(name: str) -> str:
    """The graph tensor a store name holds: ``name`` itself, or the tensor a ``copy_name`` copies."""
    return name.partition("@")[0]


def stored_alike(value: torch.Tensor, strides: tuple) -> bool:
    """Whether ``value`` is stored with ``strides``, a dim of size 1 with any stride (it moves no
    address: a batch of one passed in another order than the plan's, a library's output)."""
    return all(a == b or n == 1 for a, b, n in zip(value.stride(), strides, value.shape))


@dataclass
class Run:
    """The per-call values a launcher reads: the dropout ``seed`` of this call (Philox key, an int or
    a one-element int64 tensor on the device holding it, which the kernels read there; every mask
    at its ``dataflow.executor.dropout_offsets`` offset) and an optional ``key_padding_mask`` (bool
    (batch, keys), True = key excluded) for the attention.  ``replay``: the launchers may repeat
    their recorded launches (``datamove.kernels.replay``: the caller vouches that the tensors from outside
    are aligned, typed and strided as when they were recorded); ``blas``: besides, the cuBLAS steps
    may call cuBLASLt on pointers (``kernels.blas.LtMatmul``: PyTorch's settings are those under
    which it runs the same kernel; with the algorithm the plan names, where the tuning found another
    of cuBLASLt's faster than PyTorch's, whose call records)."""

    seed: int | torch.Tensor
    key_padding_mask: torch.Tensor | None = None
    replay: bool = False
    blas: bool = False


class Buffers:
    """Allocation of a plan's tensors in their layouts, stacked groups as one buffer each.

    ``groups``: lists of store names stored as one buffer (stack order = list order): tensors, or
    the copies layout changes make of them (``copy_name``: the members a stacked GEMM reads are
    those copies where it reads every one of them in another layout); every member is stored in the
    same layout, the same order of its own letters (checked: a member asked for in another one is
    refused, as the buffer could not hold it so)."""

    def __init__(self, graph, groups: list[list[str]], dtype: torch.dtype, device):
        self.graph, self.dtype, self.device = graph, dtype, device
        self.group_of = {t: group for group in groups for t in group}
        self._strided: dict[tuple, tuple] = {}  # (tensor, layout) -> how it is allocated (``allocate``), found once
        self._arranged: dict[str, tuple] = {}  # a group's first member -> (member, layout, order) first asked for

    def allocate(self, store: dict, tensor: str, layout: str) -> torch.Tensor:
        """``tensor`` (a store name: its slice of its group's buffer, allocated on first use) in ``layout``."""
        group = self.group_of.get(tensor)
        if group is None:
            strided = self._strided.get((tensor, layout))
            if strided is None:
                meta = allocate(self.graph, copied_tensor(tensor), layout, self.dtype, "meta")
                strided = self._strided[(tensor, layout)] = (meta.shape, meta.stride())
            return torch.empty_strided(*strided, dtype=self.dtype, device=self.device)
        stacked = self._strided.get((tensor, layout))
        if stacked is None:
            stacked = self._strided[(tensor, layout)] = self._stacked(group, tensor, layout)
        if tensor in store:
            return store[tensor]
        shape, members = stacked
        buffer = torch.empty(shape, dtype=self.dtype, device=self.device)
        for member, strided in zip(group, members):  # one view each (an index then a permute were two)
            store.setdefault(member, buffer.as_strided(*strided))
        return store[tensor]

    def _stacked(self, group: list[str], tensor: str, layout: str) -> tuple:
        """(the shape of ``group``'s buffer, each member's (shape, strides, offset) in it) for
        ``tensor`` in ``layout``; ``ValueError`` where an earlier member was asked for in another
        order of its letters."""
        letters = self.graph.tensors[copied_tensor(tensor)].letters
        order = tuple(letters.index(letter) for letter in layout)
        first, first_layout, first_order = self._arranged.setdefault(group[0], (tensor, layout, order))
        if order != first_order:
            raise ValueError(f"{tensor} is written in layout {layout}, but its stack group {group} is one buffer "
                             f"laid out as {first} in {first_layout}: every member must be in the same order of its letters")
        buffer = torch.empty([len(group), *[self.graph.size(letter) for letter in layout]], device="meta")
        member = buffer[0].permute([layout.index(letter) for letter in letters])
        return buffer.shape, [(member.shape, member.stride(), n * buffer.stride(0)) for n in range(len(group))]


def read_key(step: Step, store: dict, tensor: str) -> str:
    """The store name ``step`` reads ``tensor`` by: its layout-change copy where there is one; an
    output as written."""
    layout = step.reads.get(tensor)
    if layout is None:
        return tensor
    copied = copy_name(tensor, layout)
    return copied if copied in store else tensor


def read(step: Step, store: dict, tensor: str) -> torch.Tensor:
    """The tensor as ``step`` reads it (``read_key``)."""
    return store[read_key(step, store, tensor)]


class Launcher:
    """Base: ``step`` bound to ``graph``; ``__call__(store, run)`` writes the step's outputs into
    ``store`` through ``launch`` (the checked path), or, for a launcher whose kernels are all
    Triton kernels launched through ``kernels.launch`` (``replayable``), by repeating the launches
    its last checked call recorded (``datamove.kernels.replay``) where ``run.replay`` allows."""

    replayable = False

    def __init__(self, step: Step, graph, buffers: Buffers):
        self.step, self.graph, self.buffers = step, graph, buffers
        self.replay: StepReplay | None = None
        self.recorded = False  # whether ``replay`` comes from a whole recording (None there: not repeatable)

    @property
    def writes(self) -> dict[str, str]:
        """The store names this launcher writes, with their layouts."""
        return self.step.writes

    def output(self, store: dict, tensor: str) -> torch.Tensor:
        return self.buffers.allocate(store, tensor, self.writes[tensor])

    def __call__(self, store: dict, run: Run) -> None:
        if run.replay and self.replay is not None:
            self.replay(store, run)
        elif (run.replay and self.recorded) or not self.replayable or not isinstance(run.seed, torch.Tensor) \
                or hooked():
            self.launch(store, run)
        else:  # record this call's launches (a new recording after ``forget``)
            before = dict(store)
            with recording() as recorded:
                self.launch(store, run)
            self.replay = StepReplay.build(self, recorded, before, store, run)
            self.recorded = recorded.complete  # a launch through the JIT (a first compile): record again

    def forget(self) -> None:
        """Drop the recorded launches (the tensors from outside changed): the next call records anew."""
        self.replay, self.recorded = None, False

    def launch(self, store: dict, run: Run) -> None:
        raise NotImplementedError
