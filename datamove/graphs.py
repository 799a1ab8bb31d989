"""CUDA graphs of the exported layer: each layer instance replays its own captured forward and backward.

On a host whose CPU is slow, launching a layer's ~25 kernels from Python costs more than the
kernels themselves; a CUDA graph launches them all in one call.  ``LayerGraphs`` (one per
``datamove.module.TunedLayer`` instance) keeps ``Replayer``s per (program, key-padding mask or
not): each holds static buffers, a forward graph captured on its first use (after one warm-up
run on the capturing stream, which compiles and loads every kernel) and a backward graph captured
on its first backward, and is replayed from then on.  The design follows Megatron-core's
``CudaGraphManager``: one graph per layer and direction, a replayer busy while a backward is
outstanding, another set of buffers (or a plain launch) for a second forward.

What a replay reads and writes:
- static inputs: the activations (each call's copied in, PyTorch order; no copy where the caller
  passes the static buffer itself), the key-padding mask, the parameters and constants (the
  module's own tensors, read in place: an optimizer step updates them in place; a parameter
  whose storage moved, e.g. ``param.data = ...``, drops the layer's graphs, captured again);
- the dropout key: drawn inside the forward graph by ``torch.randint`` (a new key on every replay,
  from PyTorch's generator: ``torch.manual_seed`` and the RNG state save/restore of activation
  checkpointing apply), kept for the backward, which regenerates the forward's masks from it;
- static results: the outputs (handed out as aliases), the tensors the backward reads (kept
  inside), the gradients (handed out as the replayer's own tensor objects, so autograd's
  gradient accumulation copies them into ``.grad`` instead of keeping them: ``.grad`` never
  aliases a static buffer, and accumulating over micro-batches adds into ``.grad``).

When a replay is safe: a replayer is free when nothing outside it holds what its next forward
replay would overwrite: no autograd node from its last forward still waits for its backward (the
node saves one token tensor, the dropout key's buffer, released by autograd after the backward,
or when the graph is dropped), and no caller still holds one of its outputs.  Storage reference
counts say both.  A call that finds every replayer of its kind busy gets a new one (up to
``REPLAYERS``), else runs plainly (the custom ops).  A backward whose static gradients are still
held elsewhere runs plainly on the replayer's buffers.  Under ``torch.compile`` tracing, and inside
a CUDA graph the caller is capturing, the layer launches plainly (its launches become part of the
caller's graph).

Memory: every replayer's static buffers (inputs, outputs, kept tensors, gradients) stay allocated
for the layer's life; ``LayerGraphs.held_bytes`` counts them.  Graphs of every layer on one device
share one memory pool for their temporaries (replays never overlap: one stream order).
"""
from __future__ import annotations

import torch

from datamove.layer import SEED_RANGE, LayerProgram
from datamove.steps import Run
from kernels.codegen import allocate

REPLAYERS = 2  # static buffer sets per layer instance and kind of call: a second for a forward before the first's backward
_POOLS: dict[torch.device, tuple] = {}  # device -> graph memory pool shared by every layer's graphs
_use_count = torch._C._storage_Use_Count  # references to a storage (a tensor or view holds one each)


def _pool(device: torch.device):
    if device not in _POOLS:
        _POOLS[device] = torch.cuda.graph_pool_handle()
    return _POOLS[device]


class _Held:
    """Storages a replayer shares with the outside: ``free()`` when nothing beyond the replayer's
    own references (counted when made) holds any of them."""

    def __init__(self, tensors: list[torch.Tensor]):
        storages = {}
        for t in tensors:
            if t.numel():
                storage = t.untyped_storage()
                storages.setdefault(storage.data_ptr(), storage)
        self.storages = list(storages.values())
        self.baseline = [_use_count(s._cdata) for s in self.storages]

    def free(self) -> bool:
        return all(_use_count(s._cdata) <= n for s, n in zip(self.storages, self.baseline))

    def nbytes(self) -> int:
        return sum(s.nbytes() for s in self.storages)


def _capture(device: torch.device, run_once, record):
    """A CUDA graph of ``record()`` (whose results it returns with the graph), captured on a side
    stream after ``run_once()`` ran there (cuBLAS workspaces, kernel loading: nothing lazy inside
    the capture)."""
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        run_once()
        graph.capture_begin(pool=_pool(device), capture_error_mode="thread_local")
        try:
            results = record()
        finally:
            graph.capture_end()
    torch.cuda.current_stream(device).wait_stream(stream)
    return graph, results


class Replayer:
    """One set of static buffers with the forward and backward graphs of one program over them.

    ``activations`` / ``grad_outputs``: static buffers in PyTorch order, in the plan's layouts (so
    ``LayerProgram.to_spec`` takes them as views); ``mask``: static bool (batch, keys) or None;
    ``seed``: the forward graph's dropout key (int64 [1]).  ``outputs``, ``kept``, ``grads``: what
    the graphs write (``grads``: activations' gradients in PyTorch order, then the parameters',
    stacked groups as views of their buffer)."""

    def __init__(self, program: LayerProgram, tensors: list[torch.Tensor], mask_shape: tuple | None):
        self.program, face = program, program.interface
        device, dtype, graph = program.device, program.dtype, program.graph
        self.device = device
        spec = lambda t: allocate(graph, t, program.layouts[t], dtype, device)  # noqa: E731
        self.activations = [program.to_torch(t, spec(t).normal_()) for t in face.activations]
        self.grad_outputs = [program.to_torch(t, spec(t)) for t in face.outputs]
        self.mask = torch.zeros(mask_shape, dtype=torch.bool, device=device) if mask_shape else None
        self.others = list(tensors)  # parameters and constants: the module's, read in place
        self.seed = torch.zeros(1, dtype=torch.int64, device=device)  # the warm-up's key: draws nothing from the generator
        self.forward_graph, (self.outputs, self.kept) = _capture(
            device, lambda: program.call_forward(self._inputs(), Run(self.seed, self.mask)), self._record_forward)
        self.backward_graph, self.grads = None, []
        self.token = self.seed  # what an autograd node saves: the replayer is busy while one holds it
        self.busy = _Held([self.token] + self.outputs)
        self.grads_held: _Held | None = None

    def _inputs(self) -> list[torch.Tensor]:
        return [*self.activations, *self.others]

    def _record_forward(self):
        self.seed = torch.randint(0, SEED_RANGE, (1,), device=self.device)  # a new key on every replay
        return self.program.call_forward(self._inputs(), Run(self.seed, self.mask))

    def _backward_plainly(self) -> list[torch.Tensor]:
        return self.program.gradient_views(self.program.call_backward(
            self._inputs(), self.kept, self.grad_outputs, Run(self.seed, self.mask)))

    def free(self) -> bool:
        return self.busy.free()

    def forward(self, activations: tuple, mask: torch.Tensor | None) -> list[torch.Tensor]:
        """Replay the forward on ``activations`` (PyTorch order): the outputs, aliases of the static ones."""
        for static, x in zip(self.activations, activations):
            if static.data_ptr() != x.data_ptr():
                static.copy_(x)
        if mask is not None:
            self.mask.copy_(mask)
        self.forward_graph.replay()
        return [t.detach() for t in self.outputs]

    def backward(self, grads: tuple) -> list[torch.Tensor]:
        """The gradients from the outputs' ``grads`` (None: zero) and the last forward replay's
        kept tensors: the backward graph's own gradient tensors (captured on first use), or fresh
        ones launched plainly while a caller still holds the graph's last gradients."""
        for static, g in zip(self.grad_outputs, grads):
            if g is None:
                static.zero_()
            elif static.data_ptr() != g.data_ptr():
                static.copy_(g)
        if self.backward_graph is None:
            self.backward_graph, self.grads = _capture(self.device, self._backward_plainly, self._backward_plainly)
            self.grads_held = _Held(self.grads)
        elif not self.grads_held.free():
            return self._backward_plainly()
        self.backward_graph.replay()
        return self.grads

    def nbytes(self) -> int:
        """Bytes of the static buffers this replayer holds (the graphs' pooled temporaries not counted)."""
        tensors = [*self.activations, *self.grad_outputs, *self.outputs, *self.kept, *self.grads, self.seed]
        tensors += [self.mask] if self.mask is not None else []
        return _Held(tensors).nbytes()


class _Replayed(torch.autograd.Function):
    """One replayed layer call as an autograd node: saves the replayer's token (busy until the
    backward ran or the graph was dropped) and replays the backward graph."""

    @staticmethod
    def forward(ctx, graphs: LayerGraphs, replayer: Replayer, mask, *tensors):
        ctx.graphs, ctx.inputs = graphs, len(tensors)
        ctx.set_materialize_grads(False)
        outputs = replayer.forward(tensors[:len(replayer.activations)], mask)
        ctx.save_for_backward(replayer.token.detach())
        return tuple(outputs)

    @staticmethod
    def backward(ctx, *grads):
        (token,) = ctx.saved_tensors  # under non-reentrant checkpointing: the recomputation's replayer's
        result = ctx.graphs.owner(token).backward(grads)
        return (None, None, None, *result, *[None] * (ctx.inputs - len(result)))


class LayerGraphs:
    """The replayers of one layer instance, by (program name, mask shape or None)."""

    def __init__(self):
        self.replayers: dict[tuple, list[Replayer]] = {}
        self.pointers: tuple = ()  # the parameters' and constants' storage the graphs read

    def usable(self) -> bool:
        """Whether this call may replay: not while torch.compile traces, nor inside a capture of the caller's."""
        return not torch.compiler.is_compiling() and not torch.cuda.is_current_stream_capturing()

    def replayer(self, program: LayerProgram, tensors: list[torch.Tensor], mask: torch.Tensor | None) -> Replayer | None:
        """A free replayer for this call (made and captured if none is and fewer than
        ``REPLAYERS`` exist), or None: launch plainly."""
        pointers = tuple(t.data_ptr() for t in tensors)
        if pointers != self.pointers:
            self.replayers.clear()  # parameters moved: the graphs read the old storage
            self.pointers = pointers
        key = (program.name, None if mask is None else tuple(mask.shape))
        replayers = self.replayers.setdefault(key, [])
        for replayer in replayers:
            if replayer.free():
                return replayer
        if len(replayers) >= REPLAYERS:
            return None
        replayers.append(Replayer(program, tensors, key[1]))
        return replayers[-1]

    def owner(self, token: torch.Tensor) -> Replayer:
        """The replayer whose forward saved ``token``."""
        for replayers in self.replayers.values():
            for replayer in replayers:
                if replayer.token.data_ptr() == token.data_ptr():
                    return replayer
        raise RuntimeError("datamove: a replayed layer's backward found no graph of its forward (its parameters "
                           "moved between the forward and the backward)")

    def __call__(self, replayer: Replayer, activations: tuple, tensors: list[torch.Tensor],
                 mask: torch.Tensor | None) -> list[torch.Tensor]:
        """Replay ``replayer``'s forward: through autograd when a gradient is wanted."""
        if torch.is_grad_enabled() and any(t.requires_grad for t in (*activations, *tensors)):
            return list(_Replayed.apply(self, replayer, mask, *activations, *tensors))
        return replayer.forward(activations, mask)

    def held_bytes(self) -> int:
        """Bytes of static buffers the layer's graphs hold (``Replayer.nbytes``, summed)."""
        return sum(r.nbytes() for replayers in self.replayers.values() for r in replayers)
