"""A plan step's kernel launches repeated from a recording, without the Python that made them.

A step launched through its checked path (``datamove.runtime.steps``: views, validation, argument
templates, ``kernels.launch.DirectLaunch``'s specialisation key) costs 20-200 us of host time, more
than most of its kernels take.  Every call of one program makes the same launches with the same
integers and the same flow of pointers between steps: only the tensors are new.  ``StepReplay``
keeps, from one checked call recorded with ``kernels.launch.recording()``, each launch's compiled
kernel and arguments, and knows for every pointer argument where that call's tensor came from:

- ``read``: a tensor in the store before the step (by name; a view of it passes the same pointer);
- ``output``: a tensor the step put in the store (allocated again per call as recorded; a member of
  a stack group through the step's ``Buffers``, so that the group stays one buffer);
- ``scratch``: a tensor the step allocated and dropped (allocated again per call as recorded);
- ``seed`` / ``mask``: the call's Philox key and key-padding mask (``launcher.Run``).

Arguments at the positions a ``DirectLaunch`` marks as not varying (its template's constants, e.g.
a generated kernel's persistent split-reduction buffers) and every non-tensor argument are kept
as recorded.  A replay is valid for as long as the tensors keep the shapes, alignment, dtypes and
strides the recording had: ``datamove.runtime.layer.LayerProgram`` checks the tensors that come from
outside (inputs, parameters, the mask) on every call and records again when they change; the
store's other tensors are the program's own allocations, alike on every call.
"""
from __future__ import annotations

import torch

READ, OUTPUT, SCRATCH, SEED, MASK = "read", "output", "scratch", "seed", "mask"
AMBIGUOUS = object()  # a pointer two store names start at: which one a later call passes is not known


def _by_pointer(entries) -> dict:
    """{data pointer -> the store name of the tensor starting there, or AMBIGUOUS} over ``entries``
    (name, tensor); empty tensors left out."""
    found = {}
    for name, tensor in entries:
        if tensor.numel():
            ptr = tensor.data_ptr()
            found[ptr] = AMBIGUOUS if ptr in found else name
    return found


class StepReplay:
    """The launches of one recorded step call (module doc); ``__call__(store, run)`` repeats them."""

    def __init__(self, launcher, outputs: list[tuple], scratch: list[tuple], launches: list[tuple]):
        self.launcher = launcher
        self.outputs = outputs  # [(name, None | (shape, strides, dtype))]: None = its stack group's buffer
        self.scratch = scratch  # [(shape, strides, dtype)]
        self.launches = launches  # [(DirectLaunch, compiled, device, argument template, [(position, kind, ref)])]

    @classmethod
    def build(cls, launcher, recorded, before: dict, after: dict, run) -> "StepReplay | None":
        """The replay of the call ``recorded`` (a ``kernels.launch.Recording``) that took the store
        from ``before`` to ``after`` (name -> tensor) under ``run``; None where the call cannot be
        repeated this way (a launch through the JIT, a new store entry no argument or buffer
        explains, one pointer seen with two shapes)."""
        if not recorded.complete or not recorded.launches or not isinstance(run.seed, torch.Tensor):
            return None
        new = {name: tensor for name, tensor in after.items() if before.get(name) is not tensor}
        reads, written = _by_pointer(before.items()), _by_pointer(new.items())
        stored = {t.untyped_storage().data_ptr() for t in (*before.values(), *new.values())}
        fixed = {run.seed.data_ptr(): (SEED, None)}
        if run.key_padding_mask is not None:
            fixed[run.key_padding_mask.data_ptr()] = (MASK, None)
        scratch_slots, scratch, launches, argued = {}, [], [], set()
        for direct, compiled, device, args in recorded.launches:
            template, slots = list(args), []
            for position in range(len(args)) if direct.varying is None else direct.varying:
                value = args[position]
                if not isinstance(value, torch.Tensor):
                    continue
                ptr = value.data_ptr()
                if ptr in fixed:
                    kind, ref = fixed[ptr]
                elif ptr in reads:
                    kind, ref = READ, reads[ptr]
                elif ptr in written:
                    kind, ref = OUTPUT, written[ptr]
                    argued.add(ref)
                elif value.untyped_storage().data_ptr() in stored:
                    return None  # inside a stored tensor, not at its start: no name to read it by
                else:
                    meta = (tuple(value.shape), tuple(value.stride()), value.dtype)
                    if ptr not in scratch_slots:
                        scratch_slots[ptr] = len(scratch)
                        scratch.append(meta)
                    elif scratch[scratch_slots[ptr]] != meta:
                        return None
                    kind, ref = SCRATCH, scratch_slots[ptr]
                if ref is AMBIGUOUS:
                    return None
                template[position] = None
                slots.append((position, kind, ref))
            launches.append((direct, compiled, device, template, slots))
        outputs, covered = [], set()
        for name in new:
            group = launcher.buffers.group_of.get(name)
            if name in covered:
                continue
            written = [m for m in group or () if m in launcher.writes]
            if written:  # its group's buffer, allocated for a member the step writes, every member a slice of it
                outputs.append((written[0], None))
                covered.update(group)
            elif not group and name in argued:
                tensor = new[name]
                outputs.append((name, (tuple(tensor.shape), tuple(tensor.stride()), tensor.dtype)))
            else:
                return None
        if any(name not in covered for name in new if launcher.buffers.group_of.get(name)):
            return None
        return cls(launcher, outputs, scratch, launches)

    def __call__(self, store: dict, run) -> None:
        launcher = self.launcher
        device = launcher.buffers.device
        for name, meta in self.outputs:
            store[name] = launcher.output(store, name) if meta is None else \
                torch.empty_strided(meta[0], meta[1], dtype=meta[2], device=device)
        scratch = [torch.empty_strided(shape, strides, dtype=dtype, device=device) for shape, strides, dtype in self.scratch]
        for direct, compiled, index, template, slots in self.launches:
            args = template.copy()
            for position, kind, ref in slots:
                args[position] = (store[ref] if kind is READ or kind is OUTPUT else scratch[ref] if kind is SCRATCH
                                  else run.seed if kind is SEED else run.key_padding_mask)
            direct.fire(compiled, index, args)
