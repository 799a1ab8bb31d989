"""``TunedLayer``: the exported layer as a ``torch.nn.Module``.

Two PyTorch custom ops run a ``datamove.runtime.layer.LayerProgram``: ``datamove::layer_forward`` (its
forward steps; returns the outputs and the tensors the backward reads) and
``datamove::layer_backward`` (its backward steps), tied by ``torch.library.register_autograd``:
one autograd node per layer call, opaque to ``torch.compile`` (which traces the layer with
``fullgraph=True``: fake implementations give every output's shape and strides).  The module holds the parameters (each
a contiguous tensor over its letters in the plan's layout, ``spec_view`` giving the spec's letter
order, which the program reads; a stacked group such as Q/K/V's weights is one storage, so the
stacked GEMM reads it without a copy) and the constants (buffers, alike), and keeps the
programs of the shapes it is called at, training (the spec's dropout) and evaluation (dropout off),
made on first use, at most ``PROGRAMS_KEPT`` (``ProgramCache``: the least recently used let go).  Shapes (``datamove.runtime.shapes``): a call at a tuned shape runs that shape's
plan, any other the nearest tuned plan fitted to its sizes (one warning per layer and shape).  On
CUDA a call replays the layer's own CUDA graphs where it can (``datamove.runtime.graphs``: they read
the parameters in place, or under FSDP2, which gathers them anew for every call, copies of them
in buffers the layers of one program share) and goes through the custom ops otherwise; graphs
are kept for at most ``GRAPHED_SHAPES`` shapes per layer (a tuned shape from its first call,
another from its second: a dataloader padding each batch to its longest sequence makes many
shapes, each graphed one holding its own static buffers), other shapes launch plainly.
"""
import functools
import itertools
import json
import math
import warnings
import weakref
from collections import OrderedDict

import torch

try:
    from torch.distributed.fsdp import FSDPModule
except ImportError:  # a torch without FSDP2
    FSDPModule = None

from datamove.dataflow.initial_values import ONE, WEIGHT, CausalMask, KnownValue, initial_values
from datamove.families.attention import check_causal_constant
from datamove.kernels.interpreter import interpreted
from datamove.layouts.plan import ATTENTION_FORWARD, Plan
from datamove.runtime.graphs import LayerGraphs
from datamove.runtime.layer import (SEED_RANGE, LayerProgram, SpecOrder, TensorInterface, check, held_tensors,
                                    refuse_function_transforms, refuse_second_derivative, without_dropout)
from datamove.runtime.shapes import (call_dims, call_shape, describe, fit_plan, held_graph, nearest, position_limits,
                                     shape_key)
from datamove.runtime.steps import Run
from datamove.runtime.torch_program import TorchProgram

KERNELS, TORCH = "kernels", "torch"  # what runs a layer's plan: its kernels, or its computation in PyTorch operations


# the custom ops find their program by name, while anything holds it (its layers' ``ProgramCache``; an autograd
# context its forward's, until the backward ran): a program, its buffers and its FSDP2 statics go with the last holder
PROGRAMS: "weakref.WeakValueDictionary[str, LayerProgram]" = weakref.WeakValueDictionary()
_NAMES = itertools.count()  # program names are never reused: a CUDA graph or compiled graph names its program
GRAPHED_SHAPES = 4  # shapes per layer instance whose CUDA graphs (and their static buffers) are kept
PROGRAMS_KEPT = 64  # programs (a shape in one mode, dtype and device) a layer and its siblings keep: ``ProgramCache``
WARNED_SHAPES = 8  # shapes without a plan of their own warned about per layer (and siblings); the last says so


def register(program: LayerProgram) -> str:
    """Name ``program`` for the custom ops (a name of its own, found while the program lives)."""
    name = f"program{next(_NAMES)}"
    PROGRAMS[name] = program
    program.name = name
    return name


class ProgramCache:
    """A layer's programs (shared by its siblings) by (training, shape key, backend, dtype, device):
    at most ``PROGRAMS_KEPT``, the least recently used let go first, so that a training run whose
    batches come in many sequence lengths (a collator padding each batch to its longest) keeps a
    bounded number (each holds its launchers, its graph and its kernels' scratch buffers; one was
    kept per shape without bound).  A program let go is made again on its shape's next call (no
    kernel compiles again: Triton keeps them).  Programs that something names later are *pinned*,
    kept for the layer's life: those a ``torch.compile`` graph or a meta-device call runs through
    the custom ops (found by name, ``PROGRAMS``) and those whose CUDA graphs a layer replays (at
    most ``GRAPHED_SHAPES`` shapes per layer)."""

    def __init__(self):
        self._recent: OrderedDict[tuple, LayerProgram] = OrderedDict()  # least recently used first
        self._pinned: dict[tuple, LayerProgram] = {}
        self._pinned_names: set[str] = set()

    def get(self, key: tuple) -> LayerProgram | None:
        program = self._pinned.get(key)
        if program is None:
            program = self._recent.get(key)
            if program is not None:
                self._recent.move_to_end(key)
        return program

    def add(self, key: tuple, program: LayerProgram) -> None:
        self._recent[key] = program
        while len(self._recent) > PROGRAMS_KEPT:
            self._recent.popitem(last=False)

    def pin(self, program: LayerProgram) -> None:
        """Keep ``program`` (one of the cache's) for the layer's life."""
        if program.name in self._pinned_names:
            return
        key = next((k for k, p in self._recent.items() if p is program), None)
        if key is not None:
            self._pinned[key] = self._recent.pop(key)
            self._pinned_names.add(program.name)

    def __getstate__(self) -> dict:
        """Pickled empty (``TunedLayer.__getstate__``): one empty cache, which the copies of the
        siblings sharing this one share."""
        return {"_recent": OrderedDict(), "_pinned": {}, "_pinned_names": set()}

    def renamed(self) -> None:
        """After the programs of a layer pickled with them (before they were left out) were registered
        anew: their pins follow their new names."""
        self._pinned_names = {program.name for program in self._pinned.values()}

    def values(self) -> list[LayerProgram]:
        return [*self._pinned.values(), *self._recent.values()]

    def __len__(self) -> int:
        return len(self._pinned) + len(self._recent)


def _unaliased(tensors: list[torch.Tensor], inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    """Custom ops may not return tensors sharing memory with each other or with their ``inputs``
    (the torch backend keeps an input for the backward as it is, and one empty tensor for each
    dropout it drew no mask for): those are copied."""
    given = [t for t in inputs if t is not None]
    seen = {id(t) for t in given} | {t.untyped_storage().data_ptr() for t in given if t.numel()}
    result = []
    for t in tensors:
        keys = {id(t)} | ({t.untyped_storage().data_ptr()} if t.numel() else set())
        result.append(t.clone() if keys & seen else t)
        seen |= keys
    return result


@torch.library.custom_op("datamove::layer_forward", mutates_args=())
def layer_forward(program: str, seed: torch.Tensor, inputs: list[torch.Tensor],
                  key_padding_mask: torch.Tensor | None) -> list[torch.Tensor]:
    """The forward steps: returns the outputs (PyTorch order), then ``program.kept``."""
    outputs, kept = PROGRAMS[program].call_forward(inputs, Run(seed, key_padding_mask))
    return _unaliased(outputs + kept, [seed, *inputs, key_padding_mask])


@layer_forward.register_fake
def _(program, seed, inputs, key_padding_mask):
    prog = PROGRAMS[program]
    return [torch.empty_strided(shape, stride, dtype=dtype, device=inputs[0].device)
            for shape, stride, dtype in prog.forward_meta()]


@torch.library.custom_op("datamove::layer_backward", mutates_args=())
def layer_backward(program: str, seed: torch.Tensor, inputs: list[torch.Tensor], kept: list[torch.Tensor],
                   grads: list[torch.Tensor], key_padding_mask: torch.Tensor | None) -> list[torch.Tensor]:
    """The backward steps: gradients of the activations (PyTorch order) and parameters (a stacked
    group's as its one buffer and empty tensors, ``LayerProgram.stacked_gradients``)."""
    prog = PROGRAMS[program]
    result = prog.call_backward(inputs, kept, grads, Run(seed, key_padding_mask))
    for stacked in prog.stacked:
        result = stacked.returned(result)
    return _unaliased(result, [seed, *inputs, *kept, *grads, key_padding_mask])


@layer_backward.register_fake
def _(program, seed, inputs, kept, grads, key_padding_mask):
    prog = PROGRAMS[program]
    return [torch.empty_strided(shape, stride, dtype=dtype, device=inputs[0].device)
            for shape, stride, dtype in prog.backward_meta()]


def _setup_context(ctx, inputs, output):
    program, seed, tensors, key_padding_mask = inputs
    prog = PROGRAMS[program]
    ctx.program, ctx.program_object = program, prog  # the object: alive until the backward, whatever the layer does
    ctx.save_for_backward(seed, *tensors, *output[len(prog.interface.outputs):],
                          *([key_padding_mask] if key_padding_mask is not None else []))
    ctx.counts = (len(tensors), len(prog.kept), key_padding_mask is not None)
    ctx.set_materialize_grads(False)  # the kept tensors get no gradient: no zero tensors filled for them


def _output_grads(prog: LayerProgram, grads, device) -> list[torch.Tensor]:
    """The outputs' gradients, zeros for an output nothing downstream used (autograd passes None)."""
    if all(g is not None for g in grads):
        return list(grads)
    return [g if g is not None else torch.zeros(shape, dtype=dtype, device=device)
            for g, (shape, _, dtype) in zip(grads, prog.forward_meta())]


def _backward(ctx, grads):
    refuse_second_derivative()
    prog = PROGRAMS[ctx.program]
    inputs, kept, has_mask = ctx.counts
    saved = ctx.saved_tensors
    seed, tensors, kept_tensors_ = saved[0], list(saved[1:1 + inputs]), list(saved[1 + inputs:1 + inputs + kept])
    mask = saved[-1] if has_mask else None
    outputs = len(prog.interface.outputs)
    result = list(layer_backward(ctx.program, seed, tensors, kept_tensors_,
                                 _output_grads(prog, grads[:outputs], tensors[0].device), mask))
    for stacked in prog.stacked:
        result = stacked.views(result)
    constants = len(prog.interface.constants)
    return None, None, result + [None] * constants, None


torch.library.register_autograd("datamove::layer_forward", _backward, setup_context=_setup_context)


class _Launched(torch.autograd.Function):
    """A plain eager call: the program's steps launched directly, one autograd node, without the
    custom ops' dispatch (their argument flattening and aliasing checks cost host time on every
    call); the custom ops remain what ``torch.compile`` traces.  Its inputs are the activations and
    the parameters and constants as the layer holds them, which the program reads as ``views``
    (spec order; ``order``: the ``SpecOrder`` between the two)."""

    @staticmethod
    def forward(ctx, program: LayerProgram, seed, mask, views: list, order: SpecOrder, *tensors):
        activations = len(tensors) - len(views)
        outputs, kept = program.call_forward([*tensors[:activations], *views], Run(seed, mask))
        ctx.program, ctx.order, ctx.counts = program, order, (len(tensors), activations)
        ctx.save_for_backward(seed, mask, *tensors, *kept)
        ctx.set_materialize_grads(False)
        return tuple(outputs)

    @staticmethod
    def backward(ctx, *grads):
        refuse_second_derivative()
        program, (inputs, activations) = ctx.program, ctx.counts
        seed, mask, *saved = ctx.saved_tensors
        tensors, kept = saved[:inputs], saved[inputs:]
        spec = [*tensors[:activations], *ctx.order.spec(tensors[activations:])]
        result = program.call_backward(spec, kept, _output_grads(program, grads, spec[0].device), Run(seed, mask))
        result = ctx.order.held_grads(list(result), activations)
        return (None, None, None, None, None, *result, *[None] * (inputs - len(result)))


def _layouts(extra_state, key: str) -> dict:
    """{tensor -> layout} of a saved ``TunedLayer.get_extra_state`` (a uint8 tensor of JSON; a dict
    in state dicts saved before 2026-11-28), or {} where there is none; anything else under ``key``
    (a tensor of other values, built by hand, say) is refused in one line (``ValueError``)."""
    if extra_state is None:
        return {}
    got = f"a {type(extra_state).__name__}"
    if isinstance(extra_state, torch.Tensor):
        got = f"a {extra_state.dtype} tensor of shape {tuple(extra_state.shape)}"
        if extra_state.dtype == torch.uint8 and extra_state.dim() == 1:
            try:
                extra_state = json.loads(bytes(extra_state.cpu().tolist()).decode())
            except ValueError:  # not UTF-8, or not JSON
                got = f"a uint8 tensor of {extra_state.numel()} bytes that are not JSON"
    layouts = extra_state.get("layouts", {}) if isinstance(extra_state, dict) else None
    if not isinstance(layouts, dict) or not all(isinstance(v, str) for v in layouts.values()):
        raise ValueError(f"load_state_dict: {key}: expected the layouts a TunedLayer's state_dict saves (a uint8 "
                         f"tensor of JSON), got {got}: pass a state dict a TunedLayer gave, or leave {key} out "
                         "(the tensors are then read in the spec's letter order)")
    return layouts


def _stored_as_planned(layer, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs):
    """Load-state-dict pre-hook of ``TunedLayer``: each tensor of ``state_dict`` permuted from the
    layout it was saved in (its extra state's; a state dict without one: the spec's letter order, as
    layers stored before parameters were contiguous) into this layer's.  A value that is not a
    tensor of as many dims is left as given, for PyTorch's own check to refuse (size mismatch)."""
    saved = _layouts(state_dict.get(prefix + "_extra_state"), prefix + "_extra_state")
    for name in layer._spec_axes:
        key = prefix + name
        if key not in state_dict:
            continue
        own, letters = layer.plan.layouts[name], layer.graph.tensors[name].letters
        theirs = saved.get(name, letters)
        if sorted(theirs) != sorted(letters):
            raise ValueError(f"load_state_dict: {prefix}_extra_state gives {name} the layout {theirs!r}, not an order "
                             f"of its letters {letters!r}: pass a state dict a TunedLayer of this spec gave")
        value = state_dict[key]
        if theirs != own and isinstance(value, torch.Tensor) and value.dim() == len(own):
            state_dict[key] = value.permute([theirs.index(x) for x in own]).contiguous()
    if prefix + "_extra_state" not in state_dict:
        state_dict[prefix + "_extra_state"] = layer.get_extra_state()


def _follows_assigned(layer, incompatible_keys) -> None:
    """Load-state-dict post-hook of ``TunedLayer``: ``load_state_dict(..., assign=True)`` gives the layer
    the state dict's tensors, on their device and in their dtype (a layer made on the meta device and
    loaded so refused inputs on the device of its weights); it then computes there, as after ``.to``.
    Tensors left on several devices or in several dtypes (an assigned state dict without some of them)
    are refused in one line."""
    held = layer._held()
    found = {(t.dtype, t.device) for t in held}
    if len(found) > 1:
        raise ValueError(f"load_state_dict: the layer's parameters and constants are now in {len(found)} dtypes or "
                         f"devices ({', '.join(sorted(f'{d} on {v}' for d, v in found))}): assign all of them, or "
                         "convert the layer after loading (layer.to(device, dtype))")
    (dtype, device), = found
    own = layer.device_
    if dtype != layer.dtype or device.type != own.type or own.index not in (None, device.index):
        layer._backend_for(dtype, device)
        layer._moved_to(dtype, device)


def default_backend(device: torch.device, dtype: torch.dtype) -> str:
    """``KERNELS`` on CUDA, ``TORCH`` elsewhere and in float64 (``check_backend``)."""
    return KERNELS if device.type == "cuda" and dtype != torch.float64 else TORCH


def check_backend(backend: str, device: torch.device, dtype: torch.dtype) -> None:
    """Refuse a backend that cannot compute right on ``device`` in ``dtype``: the kernels compute in
    float32 (their generated kernels and the fused attention accumulate and take their math in
    float32: a float64 layer would be float32-accurate), and off CUDA they run only through the
    Triton interpreter (tests), there in float32 only (its bfloat16 and float16 arithmetic differs
    from a GPU's)."""
    if backend not in (KERNELS, TORCH):
        raise ValueError(f"backend {backend!r}: expected {KERNELS!r} (the plan's kernels) or {TORCH!r} "
                         "(its computation in PyTorch operations)")
    if backend == TORCH:
        return
    if dtype == torch.float64:
        raise ValueError(f"backend {KERNELS!r} in torch.float64: the plan's kernels compute in float32 (a float64 "
                         f"layer would be float32-accurate); use backend={TORCH!r} (the default in float64)")
    if device.type == "cuda":
        return
    if not interpreted():
        raise ValueError(f"backend {KERNELS!r} on {device}: the plan's Triton kernels run on a CUDA GPU (off one, only "
                         f"through Triton's interpreter, TRITON_INTERPRET=1, for kernel tests); use backend={TORCH!r}")
    if dtype != torch.float32:
        raise ValueError(f"backend {KERNELS!r} on {device} in {dtype}: the Triton interpreter does not compute "
                         f"{dtype} as a GPU does; use backend={TORCH!r} or float32")


class TunedLayer(torch.nn.Module):
    """The tuned layer.  ``forward(*inputs, key_padding_mask=None, **named_inputs)``: the data
    inputs (``interface.activations``: the spec's ``INPUTS``, e.g. ``layer(x, memory)``), in that
    order or by name (``layer(x=..., memory=...)``), each in its PyTorch order
    (``interface.torch_order``), the layer's dtype and device, any sizes of the call dims
    (``datamove.runtime.shapes.call_dims``: BERT's batch and sequence, a decoder's too), the other
    sizes those of the weights; ``key_padding_mask``: optional bool (batch, keys), True = key excluded (the fused
    attention applies it; a plan without one refuses it).  Returns the layer output(s) in PyTorch
    order; the backward gives every input that requires it and every parameter its gradient.

    ``plan``: the first tuned shape's plan (the parameters are stored in its layouts, which every
    plan shares); ``plans``: every tuned shape's plan, ``plan`` first (default: ``plan`` alone),
    over ``graph`` at their dims.  ``layer.graph`` is ``graph`` at the sizes the layer holds its
    constants at (``shapes.held_graph``: a constant over a call dim, a decoder's rotary tables,
    sized for the largest tuned T); a call at other sizes reads them at its own
    (``datamove.runtime.call_constants``), a position table no longer than it is held
    (``call_limits``).  On CUDA with ``cuda_graphs`` (the default) calls replay the
    layer's own CUDA graphs (``datamove.runtime.graphs``); otherwise, and where a replay is not possible,
    they launch the kernels (through the custom ops where ``torch.compile`` traces).

    ``dropout_off``: train without the spec's dropout (set by ``datamove.hf``'s ``replace_*`` for a
    model configured without dropout): training calls then run the evaluation program.

    ``backend``: ``"kernels"`` (the plan's kernels; the default on CUDA) or ``"torch"`` (its
    computation in PyTorch operations, ``datamove.runtime.torch_program``: the default elsewhere).

    Parameters start as ``dataflow.initial_values`` reads the graph (``reset_parameters``); a
    constant whose value the graph does not tell (anything but a causal mask) starts as NaN, and
    the layer refuses to run until it is set (``set_constant``)."""

    def __init__(self, plan: Plan, graph, operators, interface: TensorInterface, dtype: torch.dtype, device,
                 cuda_graphs: bool = True, plans: list[Plan] | None = None, backend: str | None = None):
        super().__init__()
        self.plans = list(plans or [plan])
        self.call_dims = call_dims(graph, interface)
        self.tuned_shapes = [{d: p.dims[d] for d in self.call_dims} for p in self.plans]  # [{call dim -> size}]
        graph = held_graph(graph, interface, self.tuned_shapes)
        self.plan, self.graph, self.operators, self.interface = plan, graph, operators, interface
        self._asked = (backend, cuda_graphs)  # what the caller chose; a move to another device derives again
        self._runs_in(dtype, torch.device(device))
        self.initial = initial_values(graph, interface.parameters, interface.constants)
        self.graphs = LayerGraphs()
        self.call_limits = position_limits(graph, interface, self.call_dims)  # {dim -> (size, tables)}: no longer
        self._programs = ProgramCache()  # (training, shape key, how it runs) -> program, shared by siblings
        # warned about, shared by siblings: shapes without a plan of their own (shape keys, at most WARNED_SHAPES),
        # and (dtype computed in, dtype tuned in) pairs
        self._warned_shapes: set[tuple] = set()
        self._warned_dtypes: set[tuple] = set()
        self._calls: dict[tuple, int] = {}  # shape key -> calls, this instance's (CUDA graphs policy)
        self._graphed: set[tuple] = set()  # shapes whose graphs this instance keeps
        # (constant, None for the whole or the leading sizes of a position table read in part) -> (storage, version)
        # found to hold what it must
        self._constants_checked: dict[tuple, tuple] = {}
        self._last_call: tuple | None = None  # ((mode, activations' shapes), shape, program) of the last call
        self.dropout_off = False  # train without the spec's dropout (a HF model configured without: replace_*)
        self._allocate_parameters()

    def _backend_for(self, dtype: torch.dtype, device: torch.device) -> str:
        """The backend asked for (default: ``default_backend`` of ``device`` and ``dtype``), refused where
        it cannot compute ``dtype`` there (``check_backend``)."""
        backend = self._asked[0] or default_backend(device, dtype)
        check_backend(backend, device, dtype)
        return backend

    def _runs_in(self, dtype: torch.dtype, device: torch.device) -> None:
        """Compute in ``dtype`` on ``device`` (``_backend_for``), with CUDA graphs where asked for and the
        kernels run on CUDA."""
        backend = self._backend_for(dtype, device)
        self.dtype, self.device_, self.backend = dtype, device, backend
        self.cuda_graphs = self._asked[1] and device.type == "cuda" and backend == KERNELS

    def _apply(self, fn, recurse=True):
        """``nn.Module``'s conversions (``.to``, ``.half()``, ``.cuda()``, ...): the layer then computes in
        the dtype and on the device its parameters were given, with programs made for them (it ran its
        first dtype's program on converted parameters, or refused inputs of their dtype).  A
        combination the backend cannot compute is refused before anything is converted; a dtype other
        than the plan's is warned about once: its kernels were not timed in it."""
        before = torch.empty(0, dtype=self.dtype, device=self.device_)
        after = fn(before)
        moved = isinstance(after, torch.Tensor) and (after.dtype, after.device) != (before.dtype, before.device)
        if moved:
            self._backend_for(after.dtype, after.device)  # refused before anything converts
        result = super()._apply(fn, recurse)
        if moved:
            self._moved_to(after.dtype, after.device)
        return result

    def _moved_to(self, dtype: torch.dtype, device: torch.device) -> None:
        """Compute in ``dtype`` on ``device``, where the parameters now are, with programs and graphs
        made anew; a dtype other than the plan's is warned about once: its kernels were not timed in it."""
        self._runs_in(dtype, device)
        self.graphs, self._calls, self._graphed, self._views, self._last_call = LayerGraphs(), {}, set(), {}, None
        tuned = self.plan.dtype.torch
        if dtype != tuned and (dtype, tuned) not in self._warned_dtypes:
            self._warned_dtypes.add((dtype, tuned))
            warnings.warn(f"datamove: the layer now computes in {dtype}; its plan was tuned in {tuned} "
                          f"(its kernels run untimed in {dtype}): tune it with optimize-layer --dtype", stacklevel=4)

    def _allocate_parameters(self) -> None:
        """Parameters and constants, each a contiguous tensor over its letters in the plan's layout
        (stacked groups as slices of one storage), initialised; ``spec_view`` gives the spec's order."""
        names = self.interface.parameters + self.interface.constants
        held = held_tensors(self.plan, self.graph, names, self.dtype, self.device_)
        self._spec_axes: dict[str, tuple[int, ...]] = {}  # stored (layout order) -> spec letter order
        self._views: dict[str, tuple] = {}  # name -> (what it was made of, its spec-order view): ``_spec_tensors``
        for t in names:
            layout, letters = self.plan.layouts[t], self.graph.tensors[t].letters
            stored = held[t].permute([letters.index(x) for x in layout])
            self._spec_axes[t] = tuple(layout.index(x) for x in letters)
            if t in self.interface.parameters:
                self.register_parameter(t, torch.nn.Parameter(stored))
            else:
                self.register_buffer(t, stored)
        self._order = SpecOrder(names, [self._spec_axes[t] for t in names])
        self.register_load_state_dict_pre_hook(_stored_as_planned)
        self.register_load_state_dict_post_hook(_follows_assigned)
        self.reset_parameters()

    def spec_view(self, name: str, value: torch.Tensor | None = None) -> torch.Tensor:
        """Parameter or constant ``name`` (or ``value`` stored as it is, e.g. its ``.grad``) as a view
        over its spec letters in their order (``layer.wq`` itself is over the plan's layout)."""
        axes = self._spec_axes.get(name)
        if axes is None:
            raise KeyError(f"spec_view({name!r}): not a parameter or constant of the layer; it has "
                           f"{', '.join(self._spec_axes)}")
        return (getattr(self, name) if value is None else value).permute(axes)

    def _held(self) -> list[torch.Tensor]:
        """The parameters and constants as this layer holds them (the interface's order); one that
        ``torch.nn.utils.parametrize`` (LoRA, weight norm) or ``torch.nn.utils.prune`` computes from
        another tensor, as the module attribute gives it (a KeyError before)."""
        params, buffers = self._parameters, self._buffers
        return [params[t] if t in params else buffers[t] if t in buffers else getattr(self, t) for t in self._order.names]

    def _spec_tensors(self, held: list[torch.Tensor]) -> list[torch.Tensor]:
        """``held`` as the program reads them, in spec letter order: views autograd does not record
        (the layer's autograd nodes take ``held`` and give their gradients back in its order,
        ``SpecOrder``), each made once and kept while the tensor and its storage stay the same.  A
        tensor of another shape than the layer's (``param.data = ...``) is refused in one line."""
        result = []
        for t, value, axes in zip(self._order.names, held, self._order.axes):
            made_of = (id(value), value.data_ptr())
            kept = self._views.get(t)
            if kept is None or kept[0] != made_of:
                expected = tuple(self.graph.size(x) for x in self.plan.layouts[t])
                if tuple(value.shape) != expected:
                    raise ValueError(f"layer.{t}: shape {tuple(value.shape)}, the layer's is {expected} (over "
                                     f"{', '.join(self.plan.layouts[t])}, the plan's layout): set it to a tensor of "
                                     f"that shape (layer.spec_view({t!r}) is it over the spec's letter order)")
                kept = self._views[t] = (made_of, value.detach().permute(axes))
            result.append(kept[1])
        return result

    def get_extra_state(self) -> torch.Tensor:
        """Saved with the state dict: the layout each parameter and constant is stored in, as JSON in
        a uint8 tensor (savers that take only tensors, HF's ``save_pretrained`` and safetensors,
        failed on a dict)."""
        text = json.dumps({"layouts": {t: self.plan.layouts[t] for t in self._spec_axes}}, sort_keys=True)
        return torch.tensor(list(text.encode()), dtype=torch.uint8)

    def set_extra_state(self, state) -> None:
        """Nothing to set: ``_stored_as_planned`` put the loaded tensors in this layer's layouts."""

    def __getstate__(self) -> dict:
        """Pickled (``torch.save`` of the layer or its model, ``copy.deepcopy``) without what it made for
        this process: its programs (``ProgramCache.__getstate__``; the kernels' launchers hold the
        generated kernels, functions of modules made here, which pickle cannot take: a layer that had
        run its kernels could not be saved whole) and its CUDA graphs with their per-shape counts
        (device memory and captures of this layer's own).  The copy makes its own on its first calls,
        as a loaded layer does (no kernel compiles again: Triton keeps them)."""
        state = super().__getstate__()
        state.update(_last_call=None, graphs=LayerGraphs(), _calls={}, _graphed=set())
        return state

    def __setstate__(self, state) -> None:
        """Unpickling (``torch.load`` of a saved layer or model, ``copy.deepcopy``).  A layer pickled with
        its programs (before ``__getstate__`` left them out): they are registered under names of this
        process (the custom ops find a program by name, and the pickled names were another process's:
        ``torch.compile`` of a loaded layer ran whatever program held that name here, another layer's
        training program, say, or failed with a KeyError)."""
        super().__setstate__(state)
        self.__dict__.setdefault("_last_call", None)  # layers pickled before these attributes existed
        self.__dict__.setdefault("dropout_off", False)
        if "_warned" in self.__dict__:  # one set of both kinds once
            warned = self.__dict__.pop("_warned")
            self._warned_shapes = {k for k in warned if k and isinstance(k[0], tuple)}
            self._warned_dtypes = warned - self._warned_shapes
        self.__dict__.setdefault("call_limits", {})
        if isinstance(self._programs, dict):  # a layer pickled before ``ProgramCache``
            programs, self._programs = self._programs, ProgramCache()
            for key, program in programs.items():
                self._programs.add(key, program)
        for program in self._programs.values():
            if PROGRAMS.get(program.name) is not program:
                register(program)
        self._programs.renamed()

    def sibling(self) -> "TunedLayer":
        """Another layer of the same plan (its own parameters, graphs and hooks), sharing this one's
        compiled programs.  (The hooks were shared once: ``fully_shard`` of each of 4 siblings ran all
        4 layers' FSDP2 hooks in every layer's forward and backward, 31 ms a step against 3.5.)"""
        twin = TunedLayer.__new__(TunedLayer)
        torch.nn.Module.__init__(twin)
        own = set(twin.__dict__) - {"training"}  # nn.Module's own state: parameters, buffers, hook dicts
        twin.__dict__.update({k: v for k, v in self.__dict__.items() if k not in own})
        twin.graphs, twin._calls, twin._graphed, twin._constants_checked, twin._last_call = LayerGraphs(), {}, set(), {}, None
        twin._allocate_parameters()
        return twin

    def dispatch(self, shape: dict) -> Plan:
        """The tuned plan a call at ``shape`` ({call dim -> size}) runs (``datamove.runtime.shapes.nearest``)."""
        return self.plans[nearest(self.tuned_shapes, shape)]

    def program(self, training: bool, shape: dict | None = None) -> LayerProgram:
        """The program of a call at ``shape`` (default: the first tuned shape) in training or
        evaluation mode, built on first use: the shape's own plan, else the nearest one fitted to it."""
        shape = shape or self.tuned_shapes[0]
        key = (training, shape_key(shape), self.backend, self.dtype, str(self.device_))
        program = self._programs.get(key)
        if program is None:
            tuned = self.dispatch(shape)
            graph = self.graph.with_dims({**self.graph.dim_values, **shape})
            plan = tuned if shape in self.tuned_shapes else fit_plan(tuned, graph, self.operators, self.dtype.itemsize)
            if plan is not tuned:
                self._warn_untuned(shape, tuned)
            kind = LayerProgram if self.backend == KERNELS else TorchProgram
            program = kind(plan, graph if training else without_dropout(graph), self.operators, self.interface,
                           self.dtype, self.device_, held=self.graph.dim_values)
            register(program)
            self._programs.add(key, program)
        return program

    def _warn_untuned(self, shape: dict, tuned: Plan) -> None:
        """Warn once per shape without a plan of its own, for the first ``WARNED_SHAPES`` such shapes
        (a collator padding each batch to its longest makes one per length)."""
        key = shape_key(shape)
        if key in self._warned_shapes or len(self._warned_shapes) >= WARNED_SHAPES:
            return
        self._warned_shapes.add(key)
        last = len(self._warned_shapes) == WARNED_SHAPES
        warnings.warn(f"datamove: {describe(shape)} has no plan of its own (tuned: "
                      f"{'; '.join(map(describe, self.tuned_shapes))}): it runs the plan tuned at "
                      f"{describe({d: tuned.dims[d] for d in shape})} at these sizes, made now (the layer keeps "
                      f"{PROGRAMS_KEPT}); for batches of many lengths, pad them to a multiple of 64 (HF's "
                      "DataCollatorWithPadding(pad_to_multiple_of=64)) and tune the lengths you use with "
                      f"optimize-layer --dims '{list(shape)[-1]}=128|256|512' (docs/runtime.md, Variable lengths)"
                      + ("; further shapes without a plan of their own are not warned about" if last else ""),
                      stacklevel=4)

    @torch.compiler.assume_constant_result
    def _program_made(self, training: bool, key: tuple) -> str:
        """The program of a call at shape ``key`` (``shape_key``) made where it is not yet, called
        by ``torch.compile`` as it traces ``forward`` and not traced (a shape's first program is
        fitted and compiled in Python that dynamo cannot follow): ``program`` then finds it made."""
        return self.program(training, dict(key)).name

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Parameters and constants as ``dataflow.initial_values`` reads the graph: weights (what an
        einsum reads) N(0, 0.02^2) (BERT's initialiser), scales (a norm's gain) 1, other parameters
        (biases, shifts) 0; a causal mask 0 where the key is at or before the query, -1e4 after; a
        constant the front end made (a concatenation's or a repeat's matrix) its known value; any
        other constant NaN: not set (``forward`` refuses to run until it is)."""
        for name, param in self.named_parameters():
            kind = self.initial[name]
            if kind == WEIGHT:
                param.normal_(0.0, 0.02)
            else:
                param.fill_(1.0 if kind == ONE else 0.0)
        self.reset_constants()

    @torch.no_grad()
    def reset_constants(self) -> None:
        """The constants alone as ``reset_parameters`` sets them (after ``to_empty``, say, with a
        checkpoint that does not hold them: a HF one): a causal mask or a constant of known value
        set to it, any other constant NaN (not set)."""
        for name in self.interface.constants:
            value, kind = self.spec_view(name), self.initial.get(name)
            if isinstance(kind, (CausalMask, KnownValue)):
                value.copy_(torch.from_numpy(kind.array(self.graph, name)))
            else:
                value.fill_(math.nan)

    def _holds_its_value(self, name: str, value: torch.Tensor) -> bool:
        """Whether constant ``name`` (``value``: its spec-order view) holds what the graph gives it: its
        known value, compared in the layer's dtype; a causal mask 0 at or before the query and its
        masked score or less after."""
        kind = self.initial[name]
        expected = torch.from_numpy(kind.array(self.graph, name)).to(value.device, value.dtype)
        if isinstance(kind, CausalMask):
            return bool(torch.where(expected == 0, value == 0, value <= expected).all())
        return bool((value == expected).all())

    @functools.cached_property
    def applies_key_padding(self) -> bool:
        """Whether every plan of the layer runs the fused attention, which applies a ``key_padding_mask``
        (asked on every masked call of a HF model: found once)."""
        return all(any(s.kind == ATTENTION_FORWARD for s in plan.steps) for plan in self.plans)

    @functools.cached_property
    def _caller_set(self) -> tuple[int, ...]:
        """The indices, among the parameters and constants (``_held``'s order), of the constants the
        caller sets (``set_constant``: new memory for each value), which the layer's CUDA graphs copy
        in rather than read in place (``datamove.runtime.graphs``)."""
        return tuple(n for n, t in enumerate(self._order.names) if t in self.interface.constants and t not in self.initial)

    def _drops(self) -> bool:
        """Whether this call runs the training program (the spec's dropout): in training mode, unless
        ``dropout_off`` (the evaluation program then trains: the same plan without dropout)."""
        return self.training and not self.dropout_off

    def _call_program(self, activations: tuple) -> tuple[dict, LayerProgram]:
        """The call's shape ({call dim -> size}, ``call_shape``) and program: the last call's where the
        activations have its sizes and the mode is the same (``_last_call``; ~40 us of host per call
        otherwise, a GPT-2-small layer's fwd+bwd ~0.55 ms of kernels)."""
        # the dtype, device and backend are not in the key: a move (``_moved_to``) forgets the last call
        key = (self._drops(), *(tuple(x.shape) if isinstance(x, torch.Tensor) else None for x in activations))
        last = self._last_call
        if last is not None and last[0] == key:
            return last[1], last[2]
        shape = call_shape(self.graph, self.interface, self.call_dims, activations, self.call_limits)
        program = self.program(self._drops(), shape)
        self._last_call = (key, shape, program)
        return shape, program

    def _check_mask(self, mask: torch.Tensor, program: LayerProgram) -> None:
        attention = next((s for s in program.plan.steps if s.kind == ATTENTION_FORWARD), None)
        if attention is None:
            why = str(program.plan.search.get("attention", "")).removeprefix("none: ")
            raise ValueError("key_padding_mask (a HF model's padded attention_mask): this plan runs no fused attention "
                             f"to apply it ({why or 'the selection did not take it'}); pad no batch, or tune a spec "
                             "whose attention the fused kernels take")
        letters = attention.config.letters
        expected = (program.graph.size(letters["batch"]), program.graph.size(letters["keys"]))
        check(mask, "key_padding_mask", expected, torch.bool, self.device_, letters["batch"] + letters["keys"])

    def _check_constants(self, program) -> None:
        """Every constant must be set: one the graph gives no value (``reset_parameters`` left it
        NaN) holds no NaN; one that the plan's fused attention replaces by its causal mask (GPT-2's
        additive ``causal``) holds that mask (``families.attention.check_causal_constant``); any other
        the graph gives a value (a causal mask, a concatenation's matrix) holds it (``_holds_its_value``).  Checked
        when a constant's storage or version changes (one device sync); not while compiling or
        capturing.  A position table a call reads the leading entries of (``call_constants``) is
        checked there alone, unless the whole was."""
        if torch.compiler.is_compiling() or self.device_.type == "meta" or (
                self.device_.type == "cuda" and torch.cuda.is_current_stream_capturing()):
            return
        unset, checked = [], self._constants_checked
        parts = program.at_call.leading if program.at_call is not None else {}  # position tables read in part
        for name in self.interface.constants:
            stored = self._buffers[name]
            found = (stored.data_ptr(), stored._version)
            key = (name, None)
            if checked.get(key) == found:
                continue
            value = self.spec_view(name)
            part = parts.get(name)
            if part is not None:  # its leading entries alone are read, and checked
                key = (name, part)
                if checked.get(key) == found:
                    continue
                value = value[tuple(slice(0, n) for n in part)]
            if name in program.causal_constants:  # (queries, keys): the spec adds it over those letters
                check_causal_constant(name, value)
            elif name in self.initial:
                if not self._holds_its_value(name, value):
                    what = "causal mask" if isinstance(self.initial[name], CausalMask) else "values the spec gives it"
                    raise ValueError(f"constant {name!r} does not hold its {what} (its memory was reset, by to_empty "
                                     "say, and no checkpoint held it): call layer.reset_constants()")
            elif bool(value.isnan().any()):
                unset.append(f"{name!r} (over {', '.join(self.graph.tensors[name].letters)}: {tuple(value.shape)})")
                continue
            checked[key] = found
        if unset:
            raise ValueError(f"constant(s) not set: {'; '.join(unset)}: the spec's structure gives them no value; set "
                             f"each before calling the layer, e.g. layer.set_constant({unset[0].split(' ')[0]}, values) "
                             "with values over the letters named (not layer.<name>.copy_: it is stored in the plan's layout)")

    @torch.no_grad()
    def set_constant(self, name: str, value: torch.Tensor, *, check_nan: bool = True) -> None:
        """Set a constant the graph gives no value (RoPE's tables) to ``value`` (over ``name``'s spec
        letters), taken as set: the next call does not look for NaN in it again, which on a GPU waits
        for the device.  The values go into new memory (the plan's layout), which becomes the
        constant: a call before that saved the one it read for its backward, which then still
        computes with it (two forwards before one backward, the second with other tables:
        autograd's in-place check failed the backward).  A position table (the spec's
        ``POSITION_TABLES``) may be given fewer positions along its call dims: its leading entries
        are set (positions 0..n-1, what a call at n reads: HF's tables for a shorter batch), the
        others kept as they were.  ``value`` holding NaN is refused (NaN marks a constant not set);
        ``check_nan=False`` skips that wait, for callers whose tables are made finite
        (``replace_decoder_layers`` sets the model's rotary tables whenever they change).  ``value``:
        a tensor, or anything ``torch.as_tensor`` takes (a NumPy array)."""
        value = torch.as_tensor(value)
        if name not in self.interface.constants or name in self.initial:
            raise ValueError(f"{name}: not a constant of the layer that the caller sets (constants without a value of "
                             f"their own: {[t for t in self.interface.constants if t not in self.initial]})")
        target, letters = self.spec_view(name), self.graph.tensors[name].letters
        part = None
        if tuple(value.shape) != tuple(target.shape):
            part = self._leading_part(name, tuple(value.shape))
            if part is None:
                positions = [letter for letter in letters if self.graph.letter_dims[letter] in self.call_dims]
                fewer = (f" (a position table: or fewer positions along {', '.join(positions)}, the leading ones)"
                         if name in self.interface.positions else "")
                raise ValueError(f"set_constant({name!r}): a tensor of shape {tuple(value.shape)}; {name} is over "
                                 f"{', '.join(letters)}: {tuple(target.shape)}{fewer}")
            target = target[tuple(slice(0, n) for n in part)]
        if check_nan and bool(value.isnan().any()):
            raise ValueError(f"set_constant({name!r}): the values hold NaN (at {tuple(value.isnan().nonzero()[0].tolist())} "
                             f"over {', '.join(letters)}); a constant's values must be numbers")
        old = self._buffers[name]
        with torch.inference_mode(False):  # a normal tensor, which later training calls can save
            stored = old.clone() if part is not None else torch.empty_like(old, memory_format=torch.contiguous_format)
            view = stored.permute(self._spec_axes[name])
            view[tuple(slice(0, n) for n in part or view.shape)].copy_(value)
        self._buffers[name] = stored
        self._constants_checked[(name, part)] = (stored.data_ptr(), stored._version)

    def _leading_part(self, name: str, shape: tuple) -> tuple | None:
        """``shape`` where it is a leading part of position table ``name`` (fewer entries, at least one,
        along call dims only: the positions 0..n-1 a call at n reads), else None."""
        if name not in self.interface.positions or len(shape) != len(self.graph.tensors[name].letters):
            return None
        for letter, size in zip(self.graph.tensors[name].letters, shape):
            held = self.graph.size(letter)
            if size != held and (self.graph.letter_dims[letter] not in self.call_dims or not 1 <= size < held):
                return None
        return shape

    def _graphed_shape(self, shape: dict) -> bool:
        """Whether calls at ``shape`` replay CUDA graphs (the module doc's policy)."""
        key = shape_key(shape)
        if key in self._graphed:
            return True
        if len(self._graphed) >= GRAPHED_SHAPES:  # no more: calls are not counted (one count per shape, unbounded)
            return False
        self._calls[key] = self._calls.get(key, 0) + 1
        if shape not in self.tuned_shapes and self._calls[key] < 2:
            return False
        self._graphed.add(key)
        return True

    def cuda_graph_bytes(self) -> int:
        """Bytes of static buffers this layer's CUDA graphs hold (0 before the first replay)."""
        return self.graphs.held_bytes()

    def _bound_inputs(self, positional: tuple, named: dict) -> tuple:
        """The data inputs in the interface's order, from positional and named arguments."""
        names = self.interface.activations
        if not named and len(positional) == len(names):
            return positional
        call = f"the layer is called as layer({', '.join(names)})"
        if len(positional) > len(names):
            raise TypeError(f"{len(positional)} inputs given, {call}")
        for name in named:
            if name not in names:
                held = name in self.interface.parameters or name in self.interface.constants
                raise TypeError(f"unknown input {name!r}: " + (f"{name} is held by the module (layer.{name}); "
                                                                if held else "") + call)
            if names.index(name) < len(positional):
                raise TypeError(f"input {name!r} given twice, by position and by name: {call}")
        bound = {**dict(zip(names, positional)), **named}
        missing = [name for name in names if name not in bound]
        if missing:
            raise TypeError(f"missing input(s) {', '.join(missing)}: {call}")
        return tuple(bound[name] for name in names)

    def _sharded(self) -> bool:
        """Whether FSDP2's ``fully_shard`` made this layer a unit.  FSDP2 gathers the parameters into
        new memory for each forward and backward and frees them after; the layer's graphs then read
        static copies shared by every layer of its program, into which each replay copies its call's
        parameters and constants (``LayerGraphs.replayer``'s ``copy_in``), instead of reading the
        module's in place.  (Launching its ~40 kernels plainly instead cost ~2.6 ms of host time per
        layer fwd+bwd against ~0.8 ms replayed: 2 x H200, BERT-large 24 layers, one AdamW step took
        191.7 ms under FSDP2 against 36.4 ms under DDP.)"""
        return FSDPModule is not None and isinstance(self, FSDPModule)

    def forward(self, *inputs, key_padding_mask: torch.Tensor | None = None, **named_inputs):
        compiling = torch.compiler.is_compiling()
        if not compiling:
            refuse_function_transforms()
        face = self.interface
        activations = self._bound_inputs(inputs, named_inputs)
        if compiling:
            shape = call_shape(self.graph, face, self.call_dims, activations, self.call_limits)
            self._program_made(self._drops(), shape_key(shape))
            program = self.program(self._drops(), shape)
        else:
            shape, program = self._call_program(activations)
        self._check_constants(program)
        if key_padding_mask is not None:
            self._check_mask(key_padding_mask, program)
        for t, x in zip(face.activations, activations):  # here too: a meta or fake tensor skips the op's own check
            convertible = isinstance(x, torch.Tensor) and x.is_floating_point()  # a layer computes in floats only
            check(x, t, program.torch_shapes[t], self.dtype, self.device_, face.torch_order[t],
                  " (the layer's dtype: convert the input" + (", or the layer and its model with .to({dtype}))"
                                                              if convertible else ")"))
        if compiling or self.device_.type == "meta":  # traced, or shapes only: the ops' fakes
            self._programs.pin(program)  # named by the custom ops (in a compiled graph, or until the backward)
            seed = torch.randint(0, SEED_RANGE, (1,), device=self.device_)
            tensors = [self.spec_view(t) for t in face.parameters + face.constants]
            outputs = layer_forward(program.name, seed, [*activations, *tensors], key_padding_mask)[:len(face.outputs)]
            return outputs[0] if len(outputs) == 1 else tuple(outputs)
        held = self._held()
        tensors = self._spec_tensors(held)
        if self.cuda_graphs and self.graphs.usable() and self._graphed_shape(shape):
            replayer = self.graphs.replayer(program, tensors, key_padding_mask, activations, copy_in=self._sharded(),
                                            caller_set=self._caller_set)
            if replayer is not None:
                self._programs.pin(program)  # its graphs name it: made again, it would capture them again
                outputs = self.graphs(replayer, activations, held, tensors, self._order, key_padding_mask)
                return outputs[0] if len(outputs) == 1 else tuple(outputs)
        seed = torch.randint(0, SEED_RANGE, (1,), device=self.device_)  # graph-safe: a new key per replay
        outputs = _Launched.apply(program, seed, key_padding_mask, tensors, self._order, *activations, *held)
        return outputs[0] if len(outputs) == 1 else tuple(outputs)
