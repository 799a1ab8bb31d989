"""CUDA graphs of the exported layer: each layer instance replays its own captured forward and backward.

On a host whose CPU is slow, launching a layer's ~25 kernels from Python costs more than the
kernels themselves; a CUDA graph launches them all in one call.  ``LayerGraphs`` (one per
``datamove.runtime.module.TunedLayer`` instance) keeps ``Replayer``s per (program, key-padding mask or
not): each holds static buffers, a forward graph captured on its first use (after one warm-up
run on the capturing stream, which compiles and loads every kernel) and backward graphs captured
on first need, and is replayed from then on.  The design follows Megatron-core's
``CudaGraphManager``: one graph per layer and direction, a replayer busy while a backward is
outstanding, another set of buffers (or a plain launch) for a second forward.

What a replay reads and writes:
- static inputs: the activations (each call's copied in, PyTorch order), the key-padding mask, the
  parameters and constants.  Unsharded (one GPU, DDP) a layer's graphs read the module's own
  parameters and constants in place (an optimizer step updates them in place; a parameter whose
  storage moved, e.g. ``param.data = ...``, drops the layer's graphs, captured again), except the
  constants the caller sets (RoPE's tables: ``TunedLayer.set_constant`` puts each new value in new
  memory, and HF's model gives new tables on every call): each replayer holds copies of those,
  each forward replay copying its call's in, so that a backward reads its own forward's tables
  while a later forward runs with others (two forwards before one backward).  Under
  FSDP2 (``copy_in``), which gathers the parameters into new memory for every forward and
  backward and frees them after, they read static copies shared by every layer of the program
  (``SharedStatics``): each forward replay first copies its call's parameters and constants in
  (one ``torch._foreach_copy_``), each backward replay those its autograd node saved (views of
  the storages FSDP2 gathers again for the backward).  Constants are copied too, though FSDP2
  leaves buffers where they are: the graphs then read nothing of the module in place, so no
  storage of it is watched;
- read in place instead of copied: an activation or upstream gradient that is another replay's
  static output or gradient (``reads_in_place``: in a model of replaced layers, each layer's
  input is the previous layer's output, each upstream gradient the next layer's input gradient),
  laid out as the plan stores it.  Such a graph serves only calls that hand it a tensor at that
  address; the autograd node saves the activations it reads in place, so they stay alive and
  unchanged (autograd's version check) until its backward, and the replay that wrote them stays
  busy until then.  This saves two device copies per fwd+bwd (BERT-large B=8 L=512: 13 us of 0.75 ms
  on an H100);
- the dropout key: drawn inside the forward graph by ``torch.randint`` (a new key on every replay,
  from PyTorch's generator: ``torch.manual_seed`` and the RNG state save/restore of activation
  checkpointing apply), kept for the backward, which regenerates the forward's masks from it;
- static results: the outputs, the tensors the backward reads (kept inside), the gradients; the
  outputs and gradients are handed out as fresh aliases (no copy: autograd keeps a gradient it is
  handed alone as ``.grad`` rather than copying it), and a replay never writes into a buffer that
  something outside still holds.  Under FSDP2 the gradient sets are shared too: a layer's backward
  graph computes its gradients into the pool's temporaries and ends by copying them into a shared
  set (``SharedStatics.free_gradients``).

When a replay is safe: a forward replay rewrites the replayer's outputs and kept tensors, so a
replayer is free when no autograd node from its last forward still waits for its backward (the
node saves the replayer's dropout key buffer, which autograd releases after the backward or when
the graph is dropped) and no caller still holds one of its outputs.  A backward replay
rewrites a gradient set, so it takes a set none of whose gradients is held (as ``.grad`` while
micro-batches accumulate, say: the next micro-batch's backward writes a second set, which autograd
adds into ``.grad``).  Storage reference counts say all this.  A call that finds every replayer of
its kind busy gets a new one (up to ``REPLAYERS``), else runs plainly (the custom ops); a backward
that finds every gradient set held (``GRADIENT_SETS``) runs plainly on the replayer's buffers, into
fresh tensors.  Under ``torch.compile`` tracing, and inside a CUDA graph the caller is capturing,
the layer launches plainly (its launches become part of the caller's graph).

Memory: every replayer's static buffers (inputs, outputs, kept tensors, gradient sets) stay
allocated for the layer's life; ``LayerGraphs.held_bytes`` counts them.  Graphs of every layer on
one device share one memory pool for their temporaries (replays never overlap: one stream order).
Under FSDP2 a layer's graphs hold no static parameters or gradient sets of their own: per program
(siblings share theirs: ``TunedLayer.sibling``), one layer's parameters and constants and at most
``GRADIENT_SETS`` sets of one layer's gradients (activations' and parameters'), kept with the
program (freed with it) and not counted by ``held_bytes`` (BERT-large bf16, B=8 L=512: 25 MB of parameters, 34 MB
a set; were the sets each layer's, 24 layers would hold 1.6 GB of them).  Their device cost: the
parameters copied in before each forward and backward replay, the gradients copied into a set at
the end of each backward graph, there about 170 MB read and written per layer fwd+bwd (an
estimate: ~40 us at an H200's bandwidth, against ~1.8 ms of host time a replay saves over
launching plainly).
"""
from __future__ import annotations

import warnings
import weakref

import torch

from datamove.kernels.codegen import allocate
from datamove.runtime.layer import SEED_RANGE, LayerProgram, refuse_second_derivative
from datamove.runtime.steps import Run

MOVES_TO_STOP = 3  # calls in a row with the parameters moved after which the layer stops graphing
REPLAYERS = 2  # static buffer sets per layer instance and kind of call: a second for a forward before the first's backward
GRADIENT_SETS = 2  # gradient buffers per replayer (under FSDP2: per program): a second while the first is held
# device -> the live graphs captured there, all in one memory pool (any of them names it); held weakly, so
# the pool goes back to the allocator when the last layer using it is gone
_POOLS: dict[torch.device, weakref.WeakSet] = {}
_use_count = torch._C._storage_Use_Count  # references to a storage (a tensor or view holds one each)
# storage address -> a live replayer's static output or gradient there: what other graphs may read in place
_STATIC: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


def _register_static(tensors: list[torch.Tensor]) -> None:
    for t in tensors:
        if t.numel():
            _STATIC[t.untyped_storage().data_ptr()] = t


def reads_in_place(program: LayerProgram, names: list[str], values) -> tuple:
    """Per value (PyTorch order, None allowed): its data address where a graph may read it in
    place (a live replay's static output or gradient, laid out as the plan stores ``names``'
    tensor), else None (copied into a static buffer)."""
    return tuple(v.data_ptr() if v is not None and v.untyped_storage().data_ptr() in _STATIC
                 and program.stored_as_planned(name, v) else None for name, v in zip(names, values))


def _choose(pool: list, reads: tuple, limit: int, free, capture):
    """The member of ``pool`` (replayers or gradient sets, each with ``reads``) a call takes: a free
    one reading as ``reads`` allows; else one captured with ``reads`` while fewer than ``limit``
    exist; else a free one reading copies (all None); else a free one reading other addresses,
    replaced by one captured reading copies (which serves any call from then on); else None.
    ``capture(reads)`` makes a member and appends it to ``pool`` (or returns None)."""
    copied = (None,) * len(reads)
    for wanted in dict.fromkeys((reads, copied)):
        found = next((m for m in pool if m.reads == wanted and free(m)), None)
        if found is not None:
            return found
        if len(pool) < limit:
            return capture(wanted)
    stale = next((m for m in pool if free(m)), None)
    if stale is None:
        return None
    pool.remove(stale)
    return capture(copied)


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
        for storage, n in zip(self.storages, self.baseline):
            if _use_count(storage._cdata) > n:
                return False
        return True

    def nbytes(self) -> int:
        return sum(s.nbytes() for s in self.storages)


class _Gradients:
    """The static gradients a backward graph writes, as ``LayerProgram.call_backward`` returns them
    (the activations' in PyTorch order, then the parameters', stacked groups as views of their
    buffer), ``held`` while any alias of them lives outside."""

    def __init__(self, grads: list[torch.Tensor]):
        self.grads, self.held = grads, _Held(grads)
        self._in_held_order: list | None = None  # ``aliases``' views, made on first use
        _register_static(grads)

    def aliases(self, order, activations: int) -> list[torch.Tensor]:
        """Fresh aliases of ``grads`` with the parameters' in the order the layer holds them
        (``order.held_grads``; ``activations``: how many come first), the views made once."""
        if self._in_held_order is None:
            self._in_held_order = order.held_grads(list(self.grads), activations)
            self.held = _Held(self.grads)  # its baseline counts the views just made: the set's own
        return [g.detach() for g in self._in_held_order]


def _gradients_like(program: LayerProgram) -> list[torch.Tensor]:
    """Empty tensors laid out as ``program.call_backward``'s gradients (``LayerProgram.backward_meta``,
    each stacked group's members rebuilt as views of its buffer)."""
    made = [torch.empty_strided(shape, stride, dtype=dtype, device=program.device)
            for shape, stride, dtype in program.backward_meta()]
    for stacked in program.stacked:
        made = stacked.views(made)
    return made


class SharedStatics:
    """What the graphs of every layer of one program read and write when the layers copy their
    parameters in (FSDP2; the module doc), one per program (``shared_statics``), kept with
    it.

    ``tensors``: the parameters then the constants, spec-order views laid out and sized as the module
    stores them (the plan's layouts, a constant over a call dim at the layer's sizes, a stacked group's members slices of one storage, which the stacked
    GEMM reads in place), zeros until a replay copies its layer's values in (``copy_in``).
    ``gradients``: at most ``GRADIENT_SETS`` gradient sets (``_Gradients``), into which each
    layer's backward graph copies its results, taking one nothing outside holds
    (``free_gradients``).  Replays never overlap (one stream order), and FSDP2 copies a layer's
    parameter gradients out (its reduce-scatter's input, on the same stream) and drops them right
    after the layer's backward, so two sets alternate down a stack of layers: each backward takes
    the set the previous one did not, whose input gradient it reads in place.  While a set is
    held longer (a model input's ``.grad`` kept; unsharded gradients FSDP2 accumulates under
    ``set_requires_gradient_sync(False)``), a backward that finds none free runs plainly: with one
    held, every other layer's."""

    def __init__(self, program: LayerProgram):
        face, store = program.interface, {}
        # weakly: the program holds its statics (``shared_statics``), and a strong reference back made a cycle,
        # which kept a deleted layer's program and these device buffers until Python's cyclic collector ran
        self._program = weakref.ref(program)
        held = program.held_graph  # the constants at the layer's sizes (a decoder's at another length: its T)
        self.tensors = [(allocate(held, t, program.layouts[t], program.dtype, program.device)
                         if held is not program.graph and t in face.constants else
                         program.buffers.allocate(store, t, program.layouts[t])).zero_()
                        for t in face.parameters + face.constants]
        self.gradients: list[_Gradients] = []

    def copy_in(self, tensors: list[torch.Tensor]) -> None:
        """Copy a call's parameters and constants (spec order, as ``self.tensors``) into ``self.tensors``."""
        with torch.no_grad():  # inside a backward with create_graph, a copy would join the statics to autograd's graph
            torch._foreach_copy_(self.tensors, tensors)

    def free_gradients(self) -> _Gradients | None:
        """A gradient set nothing outside holds: an existing one, else a new one while fewer than
        ``GRADIENT_SETS`` exist, else None."""
        found = next((g for g in self.gradients if g.held.free()), None)
        if found is None and len(self.gradients) < GRADIENT_SETS:
            found = _Gradients(_gradients_like(self._program()))  # alive: its caller reached these statics through it
            self.gradients.append(found)
        return found


def shared_statics(program: LayerProgram) -> SharedStatics:
    """The ``SharedStatics`` of ``program`` (on its one device; siblings share programs), made on
    first use and kept on the program (freed with it)."""
    found = program.shared_statics
    if found is None:
        found = program.shared_statics = SharedStatics(program)
    return found


def _capture(device: torch.device, run_once, record):
    """A CUDA graph of ``record()`` (whose results it returns with the graph), captured on a side
    stream after ``run_once()`` ran there (cuBLAS workspaces, kernel loading: nothing lazy inside
    the capture).  A new stream per capture: a tree capturing every graph on one stream (as
    ``torch.cuda.graph`` does) failed the graph tests on an H200, replays differing from plain
    launches (2026-11-29; the one change on that path, not run again).  Its cost: a cuBLASLt
    workspace (``kernels.blas.WORKSPACE_BYTES``) per stream of PyTorch's pool of 32 that captures
    ran on, kept for the process."""
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    graph = torch.cuda.CUDAGraph()
    keeper = next(iter(_POOLS.setdefault(device, weakref.WeakSet())), None)  # a live graph of the pool, if any
    with torch.no_grad(), torch.cuda.stream(stream):
        run_once()
        graph.capture_begin(pool=keeper.pool() if keeper else None, capture_error_mode="thread_local")
        try:
            results = record()
        finally:
            graph.capture_end()
    torch.cuda.current_stream(device).wait_stream(stream)
    _POOLS[device].add(graph)
    return graph, results


class Replayer:
    """One set of static buffers with the forward and backward graphs of one program over them.

    ``reads``: per activation (PyTorch order), the address the graphs read it from in place
    (``reads_in_place`` of the capturing call), else None: ``statics`` then holds its static
    buffer (the plan's layout, so ``LayerProgram.to_spec`` takes it as a view), each call's value
    copied in.  ``shared``: under FSDP2 the program's ``SharedStatics``, whose parameters and
    constants the graphs read (each call's copied in) and into whose gradient sets they write;
    else None.  ``others``: the parameters and constants the graphs read (spec order): the shared
    ones, else the module's own in place but at the indices ``caller_set`` (the constants the
    caller sets: the module doc), whose copies the replayer holds, each call's copied in.
    ``grad_outputs``: static buffers for the outputs'
    gradients a gradient set copies in; ``mask``: static bool (batch, keys) or None; ``seed``: the
    forward graph's dropout key (int64 [1]).  ``outputs``, ``kept``: what the forward graph
    writes; ``gradient_sets``: the backward graphs and the gradients each writes (``_GradientSet``)."""

    def __init__(self, program: LayerProgram, tensors: list[torch.Tensor], mask_shape: tuple | None,
                 activations: tuple, reads: tuple, shared: SharedStatics | None, caller_set: tuple[int, ...]):
        self.program, face = program, program.interface
        device, dtype, graph = program.device, program.dtype, program.graph
        self.device, self.reads, self.shared = device, reads, shared
        self.caller_set = caller_set if shared is None else ()  # shared: every parameter and constant copied in
        spec = lambda t: allocate(graph, t, program.layouts[t], dtype, device)  # noqa: E731
        self.statics = [None if ptr is not None else program.to_torch(t, spec(t).zero_())
                        for t, ptr in zip(face.activations, reads)]
        self.grad_outputs = [program.to_torch(t, spec(t)) for t in face.outputs]
        self.mask = torch.zeros(mask_shape, dtype=torch.bool, device=device) if mask_shape else None
        # the module's own parameters and constants detached: a view autograd recorded would keep its parameter's
        # gradient accumulator alive with the stream of the call that made it (the legacy stream), on which autograd
        # then synchronised a caller's CUDA-graph capture of fwd+bwd, failing it
        self.others = shared.tensors if shared is not None else \
            [t.detach().clone() if n in self.caller_set else t.detach() for n, t in enumerate(tensors)]
        self.seed = torch.zeros(1, dtype=torch.int64, device=device)  # the warm-up's key: draws nothing from the generator
        inputs = self._inputs(activations)
        self.forward_graph, (self.outputs, self.kept) = _capture(
            device, lambda: program.call_forward(inputs, Run(self.seed, self.mask)), lambda: self._record_forward(inputs))
        _register_static(self.outputs)
        self.gradient_sets: list[_GradientSet] = []
        self.busy = _Held([self.seed] + self.outputs)  # an autograd node saves the key: busy while one holds it

    def _inputs(self, activations) -> list[torch.Tensor]:
        """What the graphs read: the activations read in place (from ``activations``), the others'
        static buffers, then the parameters and constants."""
        return [x if static is None else static for x, static in zip(activations, self.statics)] + self.others

    def _record_forward(self, inputs):
        self.seed = torch.randint(0, SEED_RANGE, (1,), device=self.device)  # a new key on every replay
        return self.program.call_forward(inputs, Run(self.seed, self.mask))

    def _backward_plainly(self, inputs, grads) -> list[torch.Tensor]:
        return self.program.call_backward(inputs, self.kept, grads, Run(self.seed, self.mask))

    def free(self) -> bool:
        return self.busy.free()

    def forward(self, activations: tuple, mask: torch.Tensor | None, tensors) -> list[torch.Tensor]:
        """Replay the forward on ``activations`` (PyTorch order; those read in place at the addresses
        of ``reads``) and ``tensors`` (the call's parameters and constants, spec order: copied in
        where ``shared``): the outputs, aliases of the static ones."""
        if self.shared is not None:
            self.shared.copy_in(tensors)
        if self.caller_set:
            with torch.no_grad():
                torch._foreach_copy_([self.others[n] for n in self.caller_set], [tensors[n] for n in self.caller_set])
        for static, x in zip(self.statics, activations):
            if static is not None:
                static.copy_(x)
        if mask is not None:
            self.mask.copy_(mask)
        self.forward_graph.replay()
        return [t.detach() for t in self.outputs]

    def backward(self, grads: tuple, activations: tuple, tensors, order) -> list[torch.Tensor]:
        """The gradients from the outputs' ``grads`` (None: zero), the last forward replay's kept
        tensors, ``activations`` (the forward's, where read in place; None elsewhere) and ``tensors``
        (the forward's parameters and constants, as the backward finds them, copied in where
        ``shared``; else unused), as fresh aliases of a gradient set nothing outside holds (autograd
        may keep them as ``.grad``: that set then waits until they are released), the parameters'
        in the order the layer holds them (``order``: its ``runtime.layer.SpecOrder``).  A set reads the
        gradients it can in place (``reads_in_place``), chosen by ``_choose`` among at most
        ``GRADIENT_SETS``; where none serves, the backward runs plainly."""
        if self.shared is not None:
            self.shared.copy_in(tensors)
        inputs = self._inputs(activations)
        chosen = None  # where an activation read in place moved (recomputed elsewhere): the graphs read the old address
        if all(x.data_ptr() == ptr for x, ptr in zip(activations, self.reads) if ptr is not None):
            reads = reads_in_place(self.program, self.program.interface.outputs, grads)
            chosen = _choose(self.gradient_sets, reads, GRADIENT_SETS, lambda s: s.gradients.held.free(),
                             lambda wanted: self._capture_gradients(inputs, grads, wanted))
        for static, g, ptr in zip(self.grad_outputs, grads, chosen.reads if chosen else (None,) * len(grads)):
            if ptr is None:
                static.zero_() if g is None else static.copy_(g)
        if chosen is None:
            return order.held_grads(list(self._backward_plainly(inputs, self.grad_outputs)), len(self.statics))
        chosen.graph.replay()
        return chosen.gradients.aliases(order, len(self.statics))

    def _capture_gradients(self, inputs, grads, reads) -> "_GradientSet | None":
        """A backward graph reading the outputs' gradients at ``reads`` (None: from ``grad_outputs``),
        appended to ``gradient_sets``: writing gradients of its own, or where ``shared`` copying them
        into a shared set nothing outside holds (None where there is none)."""
        sources = [g if ptr is not None else static for g, ptr, static in zip(grads, reads, self.grad_outputs)]
        run = lambda: self._backward_plainly(inputs, sources)  # noqa: E731
        if self.shared is None:
            graph, written = _capture(self.device, run, run)
            gradients = _Gradients(written)
        else:
            gradients = self.shared.free_gradients()
            if gradients is None:
                return None
            graph, _ = _capture(self.device, run, lambda: torch._foreach_copy_(gradients.grads, run()))
        chosen = _GradientSet(graph, gradients, reads)
        self.gradient_sets.append(chosen)
        return chosen

    def nbytes(self) -> int:
        """Bytes of the static buffers this replayer holds (the graphs' pooled temporaries and the
        ``shared`` ones not counted)."""
        tensors = [*[t for t in self.statics if t is not None], *self.grad_outputs, *self.outputs, *self.kept, self.seed]
        tensors += ([] if self.mask is None else [self.mask]) + [self.others[n] for n in self.caller_set]
        if self.shared is None:
            tensors += [g for s in self.gradient_sets for g in s.gradients.grads]
        return _Held(tensors).nbytes()


class _GradientSet:
    """A backward graph (``Replayer.gradient_sets``) and the gradients it writes: its own, or under
    FSDP2 a set it shares with the other layers' graphs (``SharedStatics``); ``reads``: per output
    gradient, the address it reads in place, or None."""

    def __init__(self, graph, gradients: _Gradients, reads: tuple):
        self.graph, self.gradients, self.reads = graph, gradients, reads


class _Replayed(torch.autograd.Function):
    """One replayed layer call as an autograd node: saves the replayer's dropout key (busy until
    the backward ran or the graph was dropped), the activations the graphs read in place and,
    where the replayer copies parameters in (FSDP2), the call's parameters and constants (as a
    plain launch does: the storages FSDP2 frees after the forward and gathers again before the
    backward), and replays the backward graph.  Its inputs are the activations and the parameters
    and constants as the layer holds them, read as ``views`` (spec order; ``order``: the
    ``runtime.layer.SpecOrder`` between the two)."""

    @staticmethod
    def forward(ctx, graphs: LayerGraphs, replayer: Replayer, mask, views: list, order, *tensors):
        ctx.graphs, ctx.order, ctx.inputs, ctx.activation_count = graphs, order, len(tensors), len(replayer.statics)
        ctx.set_materialize_grads(False)
        activations, held = tensors[:ctx.activation_count], tensors[ctx.activation_count:]
        outputs = replayer.forward(activations, mask, views)
        ctx.save_for_backward(replayer.seed.detach(),
                              *[x if ptr is not None else None for x, ptr in zip(activations, replayer.reads)],
                              *(held if replayer.shared is not None else ()))
        return tuple(outputs)

    @staticmethod
    def backward(ctx, *grads):
        refuse_second_derivative()
        seed, *saved = ctx.saved_tensors  # under non-reentrant checkpointing: the recomputation's
        activations, held = tuple(saved[:ctx.activation_count]), saved[ctx.activation_count:]
        result = ctx.graphs.owner(seed).backward(grads, activations, ctx.order.spec(held), ctx.order)
        return (None, None, None, None, None, *result, *[None] * (ctx.inputs - len(result)))


class LayerGraphs:
    """The replayers of one layer instance, by (program name, mask shape or None); ``copy_in``:
    whether they copy the parameters and constants into the program's ``SharedStatics`` (the
    layer is an FSDP2 unit) or read the module's in place."""

    def __init__(self):
        self.replayers: dict[tuple, list[Replayer]] = {}
        self.copy_in = False
        self.pointers: list[int] = []  # read in place: the parameters' and constants' storage the graphs read
        self.moves = 0  # calls in a row whose parameters were elsewhere than the last call's
        self.failed = ""  # why capturing failed or stopped: the layer then launches plainly

    def usable(self) -> bool:
        """Whether this call may replay: not while torch.compile traces, nor inside a capture of the caller's."""
        return not (torch.compiler.is_compiling() or self.failed or torch.cuda.is_current_stream_capturing())

    def replayer(self, program: LayerProgram, tensors: list[torch.Tensor], mask: torch.Tensor | None,
                 activations: tuple, copy_in: bool, caller_set: tuple[int, ...]) -> Replayer | None:
        """A free replayer for this call (``copy_in``: its parameters and constants, ``tensors``, are
        copied in; else those at the indices ``caller_set``, the constants the caller sets: the
        module doc), reading the activations in place where ``reads_in_place`` allows, chosen by
        ``_choose`` among at most ``REPLAYERS``, or None: launch plainly."""
        if copy_in != self.copy_in:  # fully_shard applied after graphs were captured: they read other buffers
            self.replayers.clear()
            self.copy_in, self.pointers = copy_in, []
        if not copy_in and self._stopped_by_moves([t for n, t in enumerate(tensors) if n not in caller_set]):
            return None
        shared = shared_statics(program) if copy_in else None
        key = (program.name, None if mask is None else tuple(mask.shape))
        replayers = self.replayers.setdefault(key, [])
        return _choose(replayers, reads_in_place(program, program.interface.activations, activations), REPLAYERS,
                       Replayer.free,
                       lambda reads: self._captured(replayers, program, tensors, key[1], activations, reads, shared,
                                                    caller_set))

    def _stopped_by_moves(self, tensors: list[torch.Tensor]) -> bool:
        """Whether the layer stops graphing, its parameters and constants read in place (``tensors``)
        found in new memory ``MOVES_TO_STOP`` calls in a row; where they moved, the graphs
        (which read the old storage) are dropped."""
        pointers = list(map(torch.Tensor.data_ptr, tensors))
        if pointers == self.pointers:
            self.moves = 0
            return False
        self.replayers.clear()
        self.moves = self.moves + 1 if self.pointers else 0
        self.pointers = pointers
        if self.moves < MOVES_TO_STOP:
            return False
        self.failed = "its parameters are in new memory on every call (as FSDP1 gathers them)"
        warnings.warn(f"datamove: {self.failed}: the layer launches its kernels plainly instead of "
                      "capturing its CUDA graphs again each time", stacklevel=4)
        return True

    def _captured(self, replayers: list, program, tensors, mask_shape, activations, reads, shared,
                  caller_set) -> Replayer | None:
        try:
            replayers.append(Replayer(program, tensors, mask_shape, activations, reads, shared, caller_set))
        except Exception as exc:  # noqa: BLE001 - a capture that fails leaves the layer correct, launched plainly
            self.failed = f"{type(exc).__name__}: {exc}"
            warnings.warn(f"datamove: capturing the layer's CUDA graph failed ({self.failed}); it launches its "
                          "kernels plainly from now on", stacklevel=4)
            return None
        return replayers[-1]

    def owner(self, seed: torch.Tensor) -> Replayer:
        """The replayer whose forward saved ``seed`` (its dropout key's buffer)."""
        for replayers in self.replayers.values():
            for replayer in replayers:
                if replayer.seed.data_ptr() == seed.data_ptr():
                    return replayer
        raise RuntimeError("datamove: a replayed layer's backward found no graph of its forward (its parameters "
                           "moved between the forward and the backward)")

    def __call__(self, replayer: Replayer, activations: tuple, held: list[torch.Tensor], views: list[torch.Tensor],
                 order, mask: torch.Tensor | None) -> list[torch.Tensor]:
        """Replay ``replayer``'s forward: through autograd when a gradient is wanted.  ``held``: the
        layer's parameters and constants as it holds them, ``views``: the same in spec order (``order``:
        the ``runtime.layer.SpecOrder`` between the two)."""
        if torch.is_grad_enabled() and (any(x.requires_grad for x in activations) or any(t.requires_grad for t in held)):
            return list(_Replayed.apply(self, replayer, mask, views, order, *activations, *held))
        return replayer.forward(activations, mask, views)

    def held_bytes(self) -> int:
        """Bytes of static buffers the layer's graphs hold (``Replayer.nbytes``, summed; under FSDP2
        the parameters and gradient sets its program's layers share, ``SharedStatics``, not counted)."""
        return sum(r.nbytes() for replayers in self.replayers.values() for r in replayers)
