"""A plan's steps as launchers: each ``layouts.plan.Step`` bound to its kernel, ready to run on a store.

The store, its names, ``Run``, ``Buffers`` and the ``Launcher`` base: ``datamove.kernels.launcher``.  Here
the launchers of the generated kernels, the GEMMs (with their families' epilogues) and the layout
changes; a kernel family's own step kinds (the fused attention's forward and backward) are built
from its launcher table (``datamove.families.STEP_LAUNCHERS``).

Stacked tensors (the members of a stacked contraction's operand, e.g. Q/K/V's weights or their
gradients) are views of one buffer, the stack letter outermost: a stacked GEMM then reads or
writes them as one operand with no copy.  ``Buffers`` allocates such a group's buffer when the
first member is written and hands every later member its slice, so producers write in place.

Every launcher is built once (kernels compiled, dims, grids, offsets and keyword arguments
resolved) and called as ``launcher(store, run)`` where ``run`` holds the per-call values: the
dropout ``seed`` and the attention's ``key_padding_mask``.  Nothing is derived per call beyond
reading the store.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from datamove.dataflow.executor import dropout_offsets
from datamove.families import STEP_LAUNCHERS, epilogue_launch
from datamove.kernels.blas import LtMatmul
from datamove.kernels.codegen import compile_operator
from datamove.kernels.contraction import (Epilogue, cublas_call, cublas_views, gemm_plan, run_cublas,
                                         run_triton)
from datamove.kernels.gemm import GemmConfig
from datamove.kernels.layout_change import permute_copy
from datamove.kernels.launcher import Buffers, Launcher, Run, copy_name, read, read_key
from datamove.layouts.plan import GEMM, GEMM_EPILOGUE, GENERATED, LAYOUT_CHANGE, Step
from datamove.layouts.space import Configuration
from datamove.layouts.step_config import ContractionConfig, LayoutChangeConfig


def _spacing(members: list[torch.Tensor]) -> int | None:
    """The element distance between consecutive members when they are equally spaced slices of
    one storage in this order (same shape and strides), else None."""
    first = members[0]
    storage = first.untyped_storage().data_ptr()
    if len(members) < 2 or any(m.shape != first.shape or m.stride() != first.stride()
                               or m.untyped_storage().data_ptr() != storage for m in members):
        return None
    step = members[1].data_ptr() - first.data_ptr()
    if step <= 0 or step % first.element_size() or any(m.data_ptr() - first.data_ptr() != n * step
                                                       for n, m in enumerate(members)):
        return None
    return step // first.element_size()


def stacked_view(members: list[torch.Tensor]) -> torch.Tensor:
    """The members as one tensor with a leading stack dim: a view when they are equally spaced
    slices of one storage in this order (as ``Buffers`` makes them), else a copy stored in the
    members' layout with the stack dim outermost."""
    first = members[0]
    spacing = _spacing(members)
    if spacing is not None:
        return first.as_strided((len(members), *first.shape), (spacing, *first.stride()))
    order = sorted(range(first.dim()), key=lambda d: -first.stride(d))  # the members' storage order, outermost first
    buffer = torch.empty((len(members), *[first.shape[d] for d in order]), dtype=first.dtype, device=first.device)
    stacked = buffer.permute(0, *[1 + order.index(d) for d in range(first.dim())])
    for n, member in enumerate(members):
        stacked[n].copy_(member)
    return stacked


def _one_buffer(members: list[torch.Tensor]) -> bool:
    """Whether the members, in some order, are equally spaced slices of one storage."""
    return _spacing(sorted(members, key=torch.Tensor.data_ptr)) is not None


class GeneratedLauncher(Launcher):
    """A fused element-wise / normalization operator: its generated Triton kernel (``kernels.codegen``)."""

    replayable = True

    def __init__(self, step: Step, graph, buffers: Buffers, op):
        super().__init__(step, graph, buffers)
        config = Configuration({**step.reads, **step.writes, **step.config.masks}, step.config.knobs)
        self.compiled = compile_operator(graph, op, config)
        offsets = dropout_offsets(graph)
        self.masks = {t: offsets[t] for t in op.inputs if graph.tensors[t].role == "dropout"}
        self.loads = [t for t in step.reads if graph.tensors[t].role != "dropout"]

    def launch(self, store: dict, run: Run) -> None:
        outputs = {t: self.output(store, t) for t in self.step.writes}
        self.compiled.run({t: read(self.step, store, t) for t in self.loads},
                          {mask: (run.seed, offset) for mask, offset in self.masks.items()}, outputs=outputs)
        store.update(outputs)


class _OperandView(NamedTuple):
    """How one GEMM operand's view is rebuilt: ``keys`` (the store names its members are read by:
    a layout change's copy where the step reads one), ``base`` (index of the member lowest in
    memory, whose storage the view is taken of), ``expected`` (each member's (shape, strides, byte
    distance from the base)), the view's ``size``, ``stride`` and ``offset`` (elements from the
    base's storage offset; ``offset_bytes`` the same in bytes)."""

    keys: list[str]
    base: int
    expected: list[tuple]
    size: torch.Size
    stride: tuple[int, ...]
    offset: int
    offset_bytes: int


class _KeptViews:
    """A cuBLAS step's three GEMM views, derived once from the store (``_operand`` then the GEMM
    plan's views) and rebuilt per call as one ``as_strided`` of each operand's base member (or as
    its data pointer, for a direct cuBLASLt call), for as long as every member keeps the shape,
    strides, storage and distance from the base it had then (``Buffers`` allocates them alike
    every call); None from ``derive`` where an operand is a copy (members not one storage)."""

    def __init__(self, operands: list[_OperandView]):
        self.operands = operands

    @classmethod
    def derive(cls, step: Step, store: dict, operands: list[list[str]], views: list[torch.Tensor]):
        kept = []
        for members, view in zip(operands, views):
            keys = [read_key(step, store, t) for t in members]
            tensors = [store[key] for key in keys]
            base = min(range(len(tensors)), key=lambda n: tensors[n].data_ptr())
            storage = view.untyped_storage().data_ptr()
            if any(t.untyped_storage().data_ptr() != storage for t in tensors):
                return None
            start = tensors[base].data_ptr()
            offset = view.storage_offset() - tensors[base].storage_offset()
            kept.append(_OperandView(keys, base, [(t.shape, t.stride(), t.data_ptr() - start) for t in tensors],
                                     view.shape, view.stride(), offset, offset * view.element_size()))
        return cls(kept)

    @staticmethod
    def _base(store: dict, operand: _OperandView) -> torch.Tensor | None:
        """The operand's base member on this call's store, or None where a member's shape,
        strides, storage or distance from the base changed."""
        keys, base, expected = operand.keys, operand.base, operand.expected
        if len(keys) == 1:  # the common case, checked with two attribute reads (a hot path)
            first = store[keys[0]]
            return None if first.stride() != expected[0][1] or first.shape != expected[0][0] else first
        tensors = [store[key] for key in keys]
        first, start = tensors[base], tensors[base].data_ptr()
        storage = first.untyped_storage().data_ptr()
        if any((t.shape, t.stride(), t.data_ptr() - start) != e or t.untyped_storage().data_ptr() != storage
               for t, e in zip(tensors, expected)):
            return None
        return first

    def views(self, store: dict) -> list[torch.Tensor] | None:
        """The views on this call's store, or None where a member moved (derive again)."""
        result = []
        for operand in self.operands:
            first = self._base(store, operand)
            if first is None:
                return None
            result.append(first.as_strided(operand.size, operand.stride, first.storage_offset() + operand.offset))
        return result

    def pointers(self, store: dict) -> list[int] | None:
        """The views' data pointers on this call's store, for a replay (``Run.replay`` vouches for
        every tensor's shape and strides), or None where a stacked operand's members are no longer
        at their distances (not in a replay's signature; raw pointers need no common storage)."""
        result = []
        for operand in self.operands:
            keys = operand.keys
            start = store[keys[operand.base]].data_ptr()
            if len(keys) > 1 and any(store[key].data_ptr() - start != e[2] for key, e in zip(keys, operand.expected)):
                return None
            result.append(start + operand.offset_bytes)
        return result


class GemmLauncher(Launcher):
    """A contraction (stacked or not) as one GEMM, cuBLAS or the Triton template, optionally adding
    a residual (cuBLAS, beta 1) or with its element-wise consumer fused as the epilogue
    (``GEMM_EPILOGUE``: the launch of the epilogue's family, ``datamove.families.epilogue_launch``,
    then its generated kernel after it, ``rest``, where it has one).  ``ops``: the fused graph's
    operators by name."""

    def __init__(self, step: Step, graph, buffers: Buffers, ops: dict):
        super().__init__(step, graph, buffers)
        config: ContractionConfig = step.config
        self.einsum, self.backend = config.einsum, config.backend
        self.algorithm = config.algorithm  # cuBLAS: the heuristic's algorithm the tuning chose
        self.gemm_config = GemmConfig(**config.gemm) if config.gemm else None
        operands = config.operands
        self.a, self.b, self.out = list(operands["a"]), list(operands["b"]), list(operands["out"])
        self.residual = config.residual  # cuBLAS adding a tensor (D = A B + C): writes its consumer's output
        if self.residual:
            self.out = [self.residual.output]
        self.epilogue = config.epilogue and epilogue_launch(step, graph, ops)  # its family's (``datamove.families``)
        self.rest = None
        if self.epilogue and self.epilogue.after is not None:  # a generated kernel after the epilogue's GEMM
            rest_step, rest = self.epilogue.after
            self.rest = GeneratedLauncher(rest_step, graph, buffers, rest)
        self.gemm_plan = None
        self.kept_views: _KeptViews | None = None  # a cuBLAS step of one call: its views, derived once
        self.direct: LtMatmul | None = None  # and its cuBLASLt call on pointers, where one can be made

    def _operand(self, store: dict, members: list[str]) -> torch.Tensor:
        tensors = [read(self.step, store, t) for t in members]
        return tensors[0] if len(tensors) == 1 else stacked_view(tensors)

    def _added(self, store: dict) -> torch.Tensor | None:
        """The residual this step adds (config ``residual``), stored as its output (checked: the strides
        of its dims of size > 1, a dim of size 1 has any, T = 1's 'btd' and 'tbd' one storage), or None."""
        if not self.residual:
            return None
        added, out = read(self.step, store, self.residual.tensor), store[self.out[0]]
        if added.shape != out.shape or any(a != o for a, o, n in zip(added.stride(), out.stride(), out.shape) if n > 1):
            raise RuntimeError(f"{self.step.name}: the residual {self.residual.tensor} is stored "
                               f"{tuple(added.stride())}, its output {tuple(out.stride())}")
        return added

    def _cublas(self, views: tuple, added: torch.Tensor | None, store: dict) -> None:
        """PyTorch's cuBLAS call on ``views``, adding ``added`` (copied into the output first: beta 1)."""
        if added is None:
            cublas_call(*views)
            return
        store[self.out[0]].copy_(added)
        cublas_call(*views, beta=1.0)

    def launch(self, store: dict, run: Run) -> None:
        if not self.epilogue:
            for t in self.out:
                store[t] = self.output(store, t)
            added = self._added(store)
            if run.blas and self.direct is not None:
                pointers = self.kept_views.pointers(store)
                if pointers is not None:
                    self.direct(*pointers, *((added.data_ptr() + pointers[2] - store[self.out[0]].data_ptr(),)
                                             if added is not None else ()))
                    return
            views = self.kept_views.views(store) if self.kept_views is not None else None
            if views is not None:
                self._cublas(views, added, store)
                return
        stacked = [m for m in (self.out, self.a, self.b) if len(m) > 1 and m[0] in store]
        reference = next((m for m in stacked if _one_buffer([read(self.step, store, t) for t in m])), None)
        a_members, b_members, out_members = self.a, self.b, self.out
        if reference is not None:  # members in the order of the buffer they live in (``stack_groups``)
            order = sorted(range(len(reference)), key=lambda n: read(self.step, store, reference[n]).data_ptr())
            a_members, b_members, out_members = ([m[n] for n in order] if len(m) > 1 else m
                                                 for m in (self.a, self.b, self.out))
        a, b = self._operand(store, a_members), self._operand(store, b_members)
        if not self.epilogue:
            outs = [store[t] for t in out_members]
            if len(outs) > 1 and _spacing(outs) is None:  # a copy: the writes would be lost
                raise RuntimeError(f"{self.step.name}: the stacked outputs {out_members} are not one buffer")
            out = outs[0] if len(outs) == 1 else stacked_view(outs)
            if self.gemm_plan is None:  # the operands' layouts are the plan's on every call: map them once
                self.gemm_plan = gemm_plan(self.einsum, a, b, out)
            if self.backend == "cublas":
                views = cublas_views(self.gemm_plan, a, b, out)
                if views is None:
                    run_cublas(self.gemm_plan, a, b, out)
                    if added is not None:
                        out.add_(added)
                else:
                    self._cublas(views, added, store)  # PyTorch's call (the heuristic's first algorithm) while recording
                    self.kept_views = _KeptViews.derive(self.step, store, [a_members, b_members, out_members], views)
                    self.direct = LtMatmul.of(*views, self.algorithm) if self.kept_views is not None else None
            else:
                run_triton(self.gemm_plan, a, b, out, Epilogue(), self.gemm_config)
            return
        store.update(self.epilogue(a, b, lambda t: read(self.step, store, t), lambda t: self.output(store, t), run))
        if self.rest is not None:
            self.rest(store, run)


class LayoutChangeLauncher(Launcher):
    """A copy of a tensor into another layout (``kernels.layout_change.permute_copy``: one tiled kernel)."""

    replayable = True

    @property
    def writes(self) -> dict[str, str]:
        c: LayoutChangeConfig = self.step.config
        return {copy_name(c.tensor, c.target): c.target}

    def launch(self, store: dict, run: Run) -> None:
        c: LayoutChangeConfig = self.step.config
        name = copy_name(c.tensor, c.target)
        store[name] = self.output(store, name)
        permute_copy(store[c.tensor], store[name])


def stack_groups(steps: list[Step]) -> list[list[str]]:
    """The store names of what the plan's stacked GEMMs read or write as one operand, one list per
    group, in the order their buffer stacks them: a member the GEMM reads in another layout is the
    layout change's copy (``copy_name``), so that the changes write into one buffer and the GEMM
    reads it as a view (Llama's K/V gradients, changed for the stacked K/V weight GEMMs: five 8 MiB
    copies per call at 1B on an H200, 26 us, before).

    A stacked GEMM pairs its stacked operands member by member (member n of A with member n of B
    or of the output).  A group takes the order of its first appearance, and every group paired
    with it, in any step of the plan, follows that order (and so on through their pairings): a GEMM
    over two groups then reads both in one member order and stacks them as views
    (``stacked_view``), not copies.  (The weights' group, first met in the forward, orders the
    gradients' group that the backward meets first beside an unstacked operand.)"""
    changed = {(s.config.tensor, s.config.target) for s in steps if s.kind == LAYOUT_CHANGE}

    def stored(step: Step, member: str) -> str:  # the store name ``step`` reads ``member`` by (``read_key``)
        layout = step.reads.get(member)
        return copy_name(member, layout) if (member, layout) in changed else member

    links = [(step, [[stored(step, t) for t in m] for m in step.config.operands.values() if len(m) > 1])
             for step in steps if isinstance(step.config, ContractionConfig)]
    pairs: dict[frozenset, list[tuple[list[str], list[str], Step]]] = {}  # members -> (as listed, a list paired
    # with it, the step pairing them)
    for step, lists in links:
        for members in lists:
            pairs.setdefault(frozenset(members), []).extend((members, other, step) for other in lists if other is not members)
    groups: list[list[str]] = []

    def group_of(members):
        return next((g for g in groups if set(g) == set(members)), None)

    def check_apart(members, step):
        overlapped = next((g for g in groups if set(members) & set(g)), None)
        if overlapped is not None:
            err = ValueError(f"stacked operand {members} overlaps another stack group {overlapped}")
            name_step(err, step)
            raise err

    for step, members in ((step, m) for step, lists in links for m in lists):
        if group_of(members) is not None:
            continue
        check_apart(members, step)
        groups.append(list(members))
        reached = [members]
        while reached:
            order = group_of(reached.pop())
            for listed, other, pairing in pairs[frozenset(order)]:
                if group_of(other) is None:
                    check_apart(other, pairing)
                    groups.append([other[listed.index(m)] for m in order])
                    reached.append(other)
    return groups


def name_step(err: Exception, step: Step) -> None:
    """Name ``step`` on ``err``, raised while its launcher was built or run, or its stacked operand
    grouped (``stack_groups``): ``err.plan_step`` holds its name, for a caller that reports it
    (``datamove.runtime.runnable``), and a note says it to the reader of the traceback."""
    err.plan_step = step.name
    err.add_note(f"(in the plan's step {step.name}: {step.kind}, {step.phase})")


def build_launcher(step: Step, graph, ops: dict, buffers: Buffers, saves_mask: bool = False):
    """The launcher of ``step``; ``ops``: what a generated step runs, by its name
    (``layouts.space.generated_operators``); ``saves_mask``: whether the plan's attention backward
    reads the dropout mask its forward saves (passed to a family's launcher factory)."""
    if step.kind == GENERATED:
        return GeneratedLauncher(step, graph, buffers, ops[step.name])
    if step.kind in (GEMM, GEMM_EPILOGUE):
        return GemmLauncher(step, graph, buffers, ops)
    if step.kind in STEP_LAUNCHERS:  # a kernel family's own step kind (``datamove.families``)
        return STEP_LAUNCHERS[step.kind](step, graph, buffers, saves_mask)
    if step.kind == LAYOUT_CHANGE:
        return LayoutChangeLauncher(step, graph, buffers)
    raise ValueError(f"{step.name}: unknown step kind {step.kind!r}")
