"""The tuned layer: a plan's kernels run forward and backward as one ``torch.autograd.Function``.

``LayerProgram`` binds a ``layouts.plan.Plan`` to its fused training graph, a dtype and a device:
every step becomes a launcher (``datamove.runtime.steps``), built once.  ``forward`` runs the forward
steps on the layer inputs and returns the outputs and the tensors the backward reads
(``Plan.saved``); ``backward`` runs the backward steps from those and the outputs' gradients.

Tensors at the boundary (``TensorInterface``): activations (the data inputs the layer is called
with: the spec's ``INPUTS``, else ``dataflow.layer_inputs.data_inputs``, e.g. BERT's x, a
cross-attention's x and memory) and outputs are exchanged with PyTorch in ``torch_order`` (e.g.
"bji" = [batch, sequence, feature] for a tensor over letters "ibj"; spec letter order where the
spec's ``TORCH_ORDER`` gives none); parameters and constants come in their spec letter order,
stored in the plan's layouts (``TunedLayer.spec_view``).  Dropout: each call
draws one Philox key with ``torch.randint`` on the layer's device (``torch.manual_seed``
reproduces a run; inside a captured CUDA graph every replay draws a new one, as PyTorch's dropout
does); the kernels read it from device memory, and every mask is regenerated from it at its
``dataflow.executor.dropout_offsets`` offset, in the forward and again in the backward, so the
backward applies exactly the forward's mask.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from datamove.dataflow.graph import PrimitiveGraph
from datamove.dataflow.layer_inputs import data_inputs
from datamove.families.attention import saved_mask_name
from datamove.kernels.blas import DEFAULT_SETTINGS as DEFAULT_BLAS_SETTINGS, settings as blas_settings
from datamove.kernels.codegen import allocate
from datamove.kernels.launch import hooked
from datamove.kernels.launcher import stored_alike
from datamove.layouts.plan import ATTENTION_BACKWARD, ATTENTION_FORWARD, LAYOUT_CHANGE, Plan
from datamove.layouts.space import generated_operators
from datamove.runtime.call_constants import ConstantsAtCall
from datamove.runtime.steps import Buffers, Run, build_launcher, copy_name, name_step, stack_groups

SEED_RANGE = 2**31 - 1  # Philox keys drawn per call: int32 kernel arguments


@dataclass(frozen=True)
class TensorInterface:
    """How the layer's tensors meet PyTorch.

    ``activations``: the data inputs the layer is called with, in that order, exchanged in
    ``torch_order``; ``parameters``: the other inputs with a gradient (weights), held by the
    module; ``constants``: inputs without one (module buffers);
    ``outputs``: the forward's results; ``grad_outputs`` / ``input_grads``: {tensor -> its gradient
    tensor}; ``torch_order``: {activation or output -> letter order of its PyTorch shape};
    ``positions``: the constants whose entries along a call dim are positions 0, 1, ... (the
    spec's ``POSITION_TABLES``: RoPE's tables), which a call at a smaller size reads the leading
    entries of (``datamove.runtime.call_constants``)."""

    activations: tuple[str, ...]
    parameters: tuple[str, ...]
    constants: tuple[str, ...]
    outputs: tuple[str, ...]
    grad_outputs: dict[str, str]
    input_grads: dict[str, str]
    torch_order: dict[str, str]
    positions: tuple[str, ...] = ()


def tensor_interface(graph, torch_order: dict[str, str] | None = None,
                     data: tuple[str, ...] | list[str] | None = None,
                     positions: tuple[str, ...] | list[str] = ()) -> TensorInterface:
    """The interface of a training graph: ``data`` (the spec's ``INPUTS``; default
    ``dataflow.layer_inputs.data_inputs``) are the activations, in that order, the other inputs
    with a gradient parameters; gradients are the graph's ``d_<tensor>`` tensors
    (``dataflow.autodiff``'s naming); ``positions``: the spec's ``POSITION_TABLES``, each a constant
    the graph gives no value, over a dim of the activations that no parameter carries (checked)."""
    tensors = graph.tensors
    outputs = tuple(t for t in graph.outputs if tensors[t].role == "output")
    inputs = [t for t, info in tensors.items() if info.role == "input"]
    activations = tuple(data) if data is not None else data_inputs(graph)
    wrong = [t for t in activations if t not in inputs]
    if wrong or not activations or len(set(activations)) != len(activations):
        raise ValueError(f"data inputs {list(activations)}: expected distinct names among the layer's arguments "
                         f"with a gradient {inputs}" + (f"; not one: {wrong}" if wrong else ""))
    parameters = tuple(t for t in inputs if t not in activations)
    constants = tuple(t for t, info in tensors.items() if info.role == "constant")
    grad_outputs = {t: f"d_{t}" for t in outputs}
    input_grads = {t: f"d_{t}" for t in inputs}
    for name in list(grad_outputs.values()) + list(input_grads.values()):
        if name not in tensors:
            raise ValueError(f"the training graph has no gradient tensor {name!r}")
    order = {t: tensors[t].letters for t in activations + outputs}
    for t, letters in (torch_order or {}).items():
        if t not in order or sorted(letters) != sorted(tensors[t].letters):
            raise ValueError(f"torch order {t}={letters!r}: not a data input or output, or not an order of "
                             f"its letters {tensors[t].letters!r}" if t in tensors
                             else f"torch order: no tensor {t!r}; the data inputs and outputs are {', '.join(order)}")
        order[t] = letters
    _check_positions(graph, positions, constants, parameters, activations)
    return TensorInterface(activations, parameters, constants, outputs, grad_outputs, input_grads, order, tuple(positions))


def _check_positions(graph, positions, constants, parameters, activations) -> None:
    """Refuse ``positions`` (``POSITION_TABLES``) naming anything but a constant without a value of
    its own over a dim of the activations that no parameter carries (``ValueError``, one line)."""
    if isinstance(positions, str) or not all(isinstance(t, str) for t in positions):
        raise ValueError(f"POSITION_TABLES = {positions!r}: expected a tuple of constant names, e.g. (\"cos\", \"sin\")")
    dims = lambda names: {graph.letter_dims[x] for t in names for x in graph.tensors[t].letters}  # noqa: E731
    free = dims(activations) - dims(parameters)
    for t in positions:
        if t not in constants or getattr(graph.tensors[t], "value", ""):
            why = "not an argument of the layer" if t not in graph.tensors else (
                "it has a gradient (declare it Tensor(..., requires_grad=False))" if t not in constants
                else "the graph gives it its value")
            raise ValueError(f"POSITION_TABLES names {t!r}: {why}; it names constants whose values the caller sets "
                             f"(the layer's: {[c for c in constants if not getattr(graph.tensors[c], 'value', '')]})")
        if not dims([t]) & free:
            raise ValueError(f"POSITION_TABLES names {t!r}, over {', '.join(sorted(dims([t])))}: none is a sequence "
                             "dim (a dim of the data inputs that no weight carries)")


class SpecOrder:
    """The parameters and constants as a layer holds them (each contiguous over its letters in the
    plan's layout) against the spec letter order its program reads them in.  The layer's autograd
    nodes take the held tensors as inputs and read them through views made without autograd
    (``spec``), and give their gradients back in the held order (``held_grads``): autograd then
    records no permute node per parameter and call (16 nodes a BERT layer, about 11 us of host
    each, forward and backward).  ``names``: the held tensors (the interface's parameters, then its
    constants); ``axes``: per held tensor, the permutation to its spec order."""

    def __init__(self, names: tuple[str, ...], axes: list[tuple[int, ...]]):
        self.names, self.axes = names, axes
        self.inverse = [tuple(sorted(range(len(a)), key=a.__getitem__)) for a in axes]

    def spec(self, held) -> list[torch.Tensor]:
        """``held`` (the parameters and constants as held, in the interface's order) in spec order."""
        return [t.permute(a) for t, a in zip(held, self.axes)]

    def held_grads(self, grads: list, activations: int) -> list:
        """``grads`` (the activations' ``activations`` gradients, then the parameters' in spec order)
        with the parameters' in their held order."""
        return grads[:activations] + [None if g is None else g.permute(a)
                                      for g, a in zip(grads[activations:], self.inverse)]


def held_tensors(plan: Plan, graph, names, dtype: torch.dtype, device) -> dict[str, torch.Tensor]:
    """{name -> tensor} of the parameters and constants ``names`` as a ``TunedLayer`` holds them
    (uninitialised): each over its spec letters, stored densely in ``plan.layouts``, the members of
    a stack group (``stack_groups``, e.g. Q/K/V's weights) as slices of one buffer (``Buffers``)."""
    store: dict = {}
    buffers = Buffers(graph, stack_groups(plan.steps), dtype, device)
    return {t: buffers.allocate(store, t, plan.layouts[t]) for t in names}


def without_dropout(graph: PrimitiveGraph) -> PrimitiveGraph:
    """The graph with every dropout probability 0 (evaluation mode: masks of ones)."""
    tensors = {t: replace(info, p=0.0) if info.role == "dropout" else info for t, info in graph.tensors.items()}
    return PrimitiveGraph(tensors, graph.primitives, graph.letter_dims, graph.dim_values, graph.outputs)


class LayerProgram:
    """A plan's launchers for one graph, dtype and device; see the module doc.  ``held``: the sizes
    {dim -> size} the layer holds its constants at, where a call's differ (a decoder at another
    sequence length: ``datamove.runtime.call_constants``); None: ``graph``'s."""

    def __init__(self, plan: Plan, graph, operators, interface: TensorInterface, dtype: torch.dtype, device,
                 held: dict | None = None):
        self.plan, self.graph, self.interface, self.dtype, self.device = plan, graph, interface, dtype, torch.device(device)
        ops = generated_operators(graph, operators)
        self.buffers = Buffers(graph, stack_groups(plan.steps), dtype, self.device)
        reads_saved = any(s.kind == ATTENTION_BACKWARD and s.config.knobs.get("dropout_mask") == "saved"
                          for s in plan.steps)
        launchers = []
        for step in plan.steps:
            try:
                launchers.append((step.phase, build_launcher(step, graph, ops, self.buffers, reads_saved)))
            except Exception as err:
                name_step(err, step)
                raise
        self.forward_steps = [launcher for phase, launcher in launchers if phase == "forward"]
        self.backward_steps = [launcher for phase, launcher in launchers if phase == "backward"]
        # whether the attention forward saves its dropout mask for the backward (where it has one to save)
        self.saves_mask = any(launcher.saves_mask for launcher in self.forward_steps
                              if launcher.step.kind == ATTENTION_FORWARD)
        self.backward_writes = {t: layout for launcher in self.backward_steps for t, layout in launcher.step.writes.items()}
        self.layouts = plan.layouts
        self.name = ""  # the custom ops' name for it: set by datamove.runtime.module.register
        leaving = set(interface.outputs) | set(interface.input_grads.values())
        self.leaving = {s.config.tensor: copy_name(s.config.tensor, s.config.target) for s in plan.steps
                        if s.kind == LAYOUT_CHANGE and s.config.tensor in leaving}  # outputs changed to PyTorch's order
        self.torch_shapes = {t: self.shape(t, interface.torch_order[t]) for t in interface.torch_order}
        self._to_spec_axes = {t: [order.index(x) for x in graph.tensors[t].letters]
                              for t, order in interface.torch_order.items()}
        self._stored_strides = {t: allocate(graph, t, plan.layouts[t], dtype, "meta").stride()
                                for t in interface.torch_order}
        self.kept = self._kept_tensors()
        # constants the fused attention replaces by its causal mask (``datamove.runtime.module`` checks they hold it:
        # ``families.attention.check_causal_constant``)
        self.causal_constants = [launcher.step.config.causal_constant for launcher in self.forward_steps
                                 if launcher.step.kind == ATTENTION_FORWARD and launcher.step.config.causal_constant]
        at_call = ConstantsAtCall(graph, interface, held, plan.layouts, dtype, self.device, dense=True,
                                  unread=self.causal_constants)
        self.at_call = at_call if at_call else None  # constants read at the call's sizes; None at the held ones
        self.held_graph = at_call.held  # ``graph`` at the sizes the layer holds the constants at
        self.stacked = self.stacked_gradients()
        self._signatures: dict[str, tuple] = {}  # phase -> what its steps' recordings assume
        self.shared_statics = None  # what its layers' graphs read and write under FSDP2 (``runtime.graphs.shared_statics``)

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update({"shared_statics": None, "at_call": None, **state})  # programs pickled before they existed
        self.__dict__.setdefault("held_graph", self.graph)

    def _kept_tensors(self) -> list[str]:
        """What the backward steps read that neither they nor the caller provide: tensors the forward
        writes (and its layout-change copies, attention statistics), returned by the forward."""
        face = self.interface
        given = set(face.activations + face.parameters + face.constants)
        written, needed = set(), []
        for launcher in self.backward_steps:
            step = launcher.step
            names = [copy_name(t, layout) if layout != self.layouts.get(t, layout) else t for t, layout in step.reads.items()]
            roles = step.config.roles if step.kind in (ATTENTION_FORWARD, ATTENTION_BACKWARD) else {}
            if roles.get("lse"):
                names += [roles["lse"]] + ([saved_mask_name(roles["lse"])] if self.saves_mask else [])
            for t in names:  # the attention backward names its statistics twice (a read and a role)
                if t not in written and t not in needed and t not in given:
                    needed.append(t)
            written.update(step.writes)
        grads = set(face.grad_outputs.values())
        forward_names = set()
        for launcher in self.forward_steps:
            forward_names.update(launcher.step.writes)
            forward_names.update(copy_name(t, l) for t, l in launcher.step.reads.items())
            if launcher.step.kind == ATTENTION_FORWARD:
                forward_names.update((launcher.lse, saved_mask_name(launcher.lse)) if self.saves_mask else (launcher.lse,))
        return [t for t in needed if t not in grads and t in forward_names]

    def shape(self, tensor: str, order: str | None = None) -> tuple[int, ...]:
        """The tensor's shape in ``order`` (default: its spec letter order)."""
        return tuple(self.graph.size(letter) for letter in (order or self.graph.tensors[tensor].letters))

    def to_spec(self, tensor: str, value: torch.Tensor, what: str) -> torch.Tensor:
        """A PyTorch-side activation or gradient as its spec-order view, stored in the plan layout
        (a copy only where the caller's strides differ from it)."""
        check(value, what, self.torch_shapes[tensor], self.dtype, self.device, self.interface.torch_order[tensor])
        view = value.permute(self._to_spec_axes[tensor])
        if stored_alike(view, self._stored_strides[tensor]):
            return view
        return allocate(self.graph, tensor, self.layouts[tensor], self.dtype, self.device).copy_(view)

    def stored_as_planned(self, tensor: str, value: torch.Tensor) -> bool:
        """Whether ``value`` (PyTorch order, the checked shape, dtype and device) is laid out as the
        plan stores ``tensor``: ``to_spec`` then reads it in place."""
        return stored_alike(value.permute(self._to_spec_axes[tensor]), self._stored_strides[tensor])

    def leaving_value(self, store: dict, tensor: str) -> torch.Tensor:
        """An output or gradient as it leaves the layer: its copy in PyTorch's order where the plan makes one."""
        return store[self.leaving.get(tensor, tensor)]

    def to_torch(self, tensor: str, value: torch.Tensor) -> torch.Tensor:
        letters = self.graph.tensors[tensor].letters
        return value.permute([letters.index(letter) for letter in self.interface.torch_order[tensor]])

    def _meta(self, name: str) -> tuple[tuple, tuple, torch.dtype]:
        """(shape, strides, dtype) of what the store holds under ``name`` (``kept`` entries)."""
        for launcher in self.forward_steps:
            if launcher.step.kind == ATTENTION_FORWARD and name in (launcher.lse, saved_mask_name(launcher.lse)):
                letters = launcher.step.config.letters
                rows = tuple(self.graph.size(letters[r]) for r in ("batch", "heads", "rows"))
                if name == launcher.lse:
                    return rows, tuple(torch.empty(rows, device="meta").stride()), torch.float32
                shape = (*rows, self.graph.size(letters["keys"]) // 16)
                return shape, tuple(torch.empty(shape, device="meta").stride()), torch.int16
        tensor, _, layout = name.partition("@")
        meta = allocate(self.graph, tensor, layout or self.layouts[tensor], self.dtype, "meta")
        return tuple(meta.shape), tuple(meta.stride()), self.dtype

    def forward_meta(self) -> list[tuple[tuple, tuple, torch.dtype]]:
        """(shape, strides, dtype) of the forward op's results: the outputs in PyTorch order, then ``kept``."""
        result = []
        for t in self.interface.outputs:
            shape, stride, dtype = self._meta(self.leaving.get(t, t))
            letters, order = self.graph.tensors[t].letters, self.interface.torch_order[t]
            perm = [letters.index(x) for x in order]
            result.append((tuple(shape[d] for d in perm), tuple(stride[d] for d in perm), dtype))
        return result + [self._meta(t) for t in self.kept]

    def stacked_gradients(self) -> list[StackedGradients]:
        """The parameters whose gradients one stacked GEMM writes into one buffer (e.g. Q/K/V's
        weights): the backward op returns that buffer once, in the first member's place, and an
        empty tensor in the others' (custom-op results may not share storage; cloning two of three
        was 4 us per call on the H200); ``StackedGradients.views`` rebuilds each member's gradient."""
        results = self.interface.activations + self.interface.parameters
        found = []
        for group in {id(g): g for g in self.buffers.group_of.values()}.values():
            members = {n: results.index(t) for t in self.interface.parameters
                       for n, member in enumerate(group) if member == self.interface.input_grads[t]}
            if len(members) < 2 or any(self.interface.input_grads[results[i]] in self.leaving for i in members.values()):
                continue
            member = group[min(members)]
            layout, letters = self.backward_writes[member], self.graph.tensors[member].letters
            shape = (len(group), *self.shape(member, layout))
            found.append(StackedGradients(members, shape, tuple(torch.empty(shape, device="meta").stride()),
                                          tuple(layout.index(x) for x in letters)))
        return found

    def backward_meta(self) -> list[tuple[tuple, tuple, torch.dtype]]:
        """(shape, strides, dtype) of the backward op's results: activations' gradients in PyTorch
        order, then the parameters' in the layouts the gradient steps write (a stacked group's
        buffer and empty tensors in its members' places: ``self.stacked``)."""
        result = []
        for t in self.interface.activations + self.interface.parameters:
            grad = self.interface.input_grads[t]
            layout = self.leaving[grad].partition("@")[2] if grad in self.leaving else self.backward_writes[grad]
            meta = allocate(self.graph, grad, layout, self.dtype, "meta")
            shape, stride = tuple(meta.shape), tuple(meta.stride())
            if t in self.interface.activations:
                letters, order = self.graph.tensors[grad].letters, self.interface.torch_order[t]
                perm = [letters.index(x) for x in order]
                shape, stride = tuple(shape[d] for d in perm), tuple(stride[d] for d in perm)
            result.append((shape, stride, self.dtype))
        for stacked in self.stacked:
            for n, index in stacked.members.items():
                result[index] = (stacked.shape, stacked.strides, self.dtype) if n == min(stacked.members) \
                    else ((0,), (1,), self.dtype)
        return result

    def forward(self, store: dict, run: Run) -> dict:
        """Run the forward steps on ``store`` (activations, parameters, constants as spec-order
        views); returns the store with every tensor they wrote."""
        self._allow_replays("forward", store, run)
        _launch(self.forward_steps, store, run)
        return store

    def backward(self, store: dict, run: Run) -> dict:
        self._allow_replays("backward", store, run)
        _launch(self.backward_steps, store, run)
        return store

    def _allow_replays(self, phase: str, store: dict, run: Run) -> None:
        """Let the ``phase`` ("forward" or "backward") steps repeat their recorded launches
        (``datamove.kernels.replay``) where every tensor from outside (``store`` before the steps, the
        key-padding mask) has the shape, 16-byte alignment, dtype and strides it had when they were
        recorded, on the same current device and with no launch hook set (a profiler's, which
        replays would bypass); otherwise they forget their recordings and record this call.  On
        CUDA, replayed cuBLAS steps call cuBLASLt directly where PyTorch's settings allow
        (``Run.blas``)."""
        mask = run.key_padding_mask
        current = torch._C._cuda_getDevice() if self.device.type == "cuda" else -1
        signature = (tuple((x.shape, x.data_ptr() & 15, x.dtype, x.stride()) for x in store.values()),
                     None if mask is None else (mask.shape, mask.data_ptr() & 15, mask.dtype, mask.stride()),
                     current, hooked())
        if self._signatures.get(phase) == signature:
            run.replay = True  # cuBLASLt runs on the current device: only where the tensors are there
            run.blas = current == next(iter(store.values())).device.index and blas_settings() == DEFAULT_BLAS_SETTINGS
            return
        self._signatures[phase] = signature
        for launcher in self.forward_steps if phase == "forward" else self.backward_steps:
            launcher.forget()

    def input_store(self, inputs: list[torch.Tensor]) -> dict:
        """A store of the layer's inputs: ``inputs`` are the activations (PyTorch order, checked),
        parameters and constants (as the layer holds them: ``at_call`` reads them at the call's
        sizes), in the interface's order."""
        face = self.interface
        names = face.activations + face.parameters + face.constants
        if len(inputs) != len(names):
            raise TypeError(f"expected {len(names)} tensors {names}, got {len(inputs)}")
        store = {t: self.to_spec(t, x, t) if t in face.activations else x for t, x in zip(names, inputs)}
        return store if self.at_call is None else self.at_call.take(store)

    def call_forward(self, inputs: list[torch.Tensor], run: Run) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The forward on ``inputs`` (``input_store``'s): (the outputs in PyTorch order, the
        ``kept`` tensors the backward reads)."""
        store = self.forward(self.input_store(inputs), run)
        return [self.to_torch(t, self.leaving_value(store, t)) for t in self.interface.outputs], [store[t] for t in self.kept]

    def call_backward(self, inputs: list[torch.Tensor], kept: list[torch.Tensor], grads: list[torch.Tensor],
                      run: Run) -> list[torch.Tensor]:
        """The backward from ``call_forward``'s ``kept`` and the outputs' gradients (PyTorch order):
        the gradients of the activations (PyTorch order) and of the parameters (spec order, in the
        layouts the gradient steps write; a stacked group's members are views of its one buffer)."""
        face = self.interface
        store = {**self.input_store(inputs), **dict(zip(self.kept, kept))}
        for t, grad in zip(face.outputs, grads):
            store[face.grad_outputs[t]] = self.to_spec(t, grad, f"gradient of {t}")
        self.backward(store, run)
        return [self.to_torch(t, self.leaving_value(store, face.input_grads[t])) if t in face.activations
                else self.leaving_value(store, face.input_grads[t]) for t in face.activations + face.parameters]


def _launch(launchers: list, store: dict, run: Run) -> None:
    """Each launcher on ``store`` in turn; an error names the step it was raised in (``name_step``)."""
    for launcher in launchers:
        try:
            launcher(store, run)
        except Exception as err:
            name_step(err, launcher.step)
            raise


@dataclass(frozen=True)
class StackedGradients:
    """Parameter gradients stored as one buffer (``LayerProgram.stacked_gradients``): ``members``
    {stack index -> position among the backward op's results}, the buffer's ``shape`` (stack
    count, then the write layout's sizes) and row-major ``strides``, ``axes``: the buffer axes of a
    member's spec letters."""

    members: dict[int, int]
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    axes: tuple[int, ...]

    def returned(self, results: list[torch.Tensor]) -> list[torch.Tensor]:
        """The backward's results with the buffer once, in the first member's place (checked: every
        member is its slice of that buffer; inside a custom op views keep no ``_base``, so the
        buffer is rebuilt over the first member's storage)."""
        first = min(self.members)
        head = results[self.members[first]]
        buffer = head.as_strided(self.shape, self.strides, head.storage_offset() - first * self.strides[0])
        for n, index in self.members.items():
            view = buffer[n].permute(self.axes)
            if results[index].data_ptr() != view.data_ptr() or results[index].stride() != view.stride():
                raise RuntimeError(f"stacked gradients: result {index} is not slice {n} of its group's buffer")
        results = list(results)
        for n, index in self.members.items():
            results[index] = buffer if n == first else buffer.new_empty(0)
        return results

    def views(self, results: list[torch.Tensor]) -> list[torch.Tensor]:
        """Each member's gradient again, a view of the buffer ``returned`` put in the first place."""
        buffer = results[self.members[min(self.members)]]
        results = list(results)
        for n, index in self.members.items():
            results[index] = buffer[n].permute(self.axes)
        return results


def refuse_second_derivative() -> None:
    """Called first in the layer's backward: under ``create_graph=True`` (a gradient penalty, a
    Hessian-vector product) autograd runs it with grad mode on, and its steps are not differentiable."""
    if torch.is_grad_enabled():
        raise RuntimeError("datamove: the tuned layer's backward is not differentiable: a second derivative through "
                           "it (autograd.grad(..., create_graph=True), a gradient penalty) is not supported")


def refuse_function_transforms() -> None:
    """Called first in the layer's eager forward: ``torch.func``'s transforms (``grad``, ``vmap``,
    ``jacrev``, ``jvp``) run it on wrapped tensors, which hold no memory for its steps (and its
    autograd node has no rule for them): they failed deep inside with "Cannot access data pointer"."""
    if torch._C._functorch.peek_interpreter_stack() is not None:
        raise RuntimeError("datamove: the tuned layer does not run under torch.func transforms (grad, vmap, jacrev, "
                           "jvp, ...): take gradients with torch.autograd (loss.backward() or torch.autograd.grad), "
                           "with torch.func.functional_call for substituted parameters")


def check(value, what: str, shape: tuple, dtype: torch.dtype, device: torch.device, order: str = "",
          dtype_hint: str = "") -> None:
    """Refuse a tensor of another shape, dtype or device, naming the expected ones (``dtype_hint``:
    what to do about another dtype, appended, its ``{dtype}`` the tensor's: formatted only then)."""
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{what}: expected a torch.Tensor, got {type(value).__name__}")
    if tuple(value.shape) != tuple(shape):
        named = f" ({', '.join(order)})" if order else ""
        raise ValueError(f"{what}: shape {tuple(value.shape)}, expected {tuple(shape)}{named} at this call's sizes")
    if value.dtype != dtype:
        raise TypeError(f"{what}: dtype {value.dtype}, expected {dtype}{dtype_hint.format(dtype=value.dtype)}")
    if value.device.type != device.type or (device.index is not None and value.device.index not in (None, device.index)):
        raise ValueError(f"{what}: on device {value.device}, expected {device}")
