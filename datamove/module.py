"""``TunedLayer``: the exported layer as a ``torch.nn.Module``.

Two PyTorch custom ops run a ``datamove.layer.LayerProgram``: ``datamove::layer_forward`` (its
forward steps; returns the outputs and the tensors the backward reads) and
``datamove::layer_backward`` (its backward steps), tied by ``torch.library.register_autograd``:
one autograd node per layer call, opaque to ``torch.compile`` (which traces the layer with
``fullgraph=True``: fake implementations give every output's shape and strides).  The module holds the parameters (shape:
spec letter order; storage: the plan's layouts; a stacked group such as Q/K/V's weights is one
storage, so the stacked GEMM reads it without a copy) and the constants (buffers), and keeps two
programs: training (the spec's dropout) and evaluation (dropout off), compiled on first use.
"""
import torch

from datamove.layer import SEED_RANGE, LayerProgram, TensorInterface, check, without_dropout
from datamove.steps import Run, copy_name, saved_mask_name
from layouts.plan import ATTENTION_FORWARD, Plan


PROGRAMS: dict[str, LayerProgram] = {}  # the custom ops find their program by name


def register(program: LayerProgram) -> str:
    """Name ``program`` for the custom ops (one name per program, kept for the process)."""
    name = f"program{len(PROGRAMS)}"
    PROGRAMS[name] = program
    program.name = name
    program.kept = kept_tensors(program)
    program.stacked = program.stacked_gradients()
    return name


def kept_tensors(program: LayerProgram) -> list[str]:
    """What the backward steps read that neither they nor the caller provide: tensors the forward
    writes (and its layout-change copies, attention statistics), returned by the forward op."""
    face = program.interface
    given = set(face.activations + face.parameters + face.constants)
    written, needed = set(), []
    for launcher in program.backward_steps:
        step = launcher.step
        names = [copy_name(t, layout) if layout != program.layouts.get(t, layout) else t for t, layout in step.reads.items()]
        roles = step.config.get("roles", {})
        if roles.get("lse"):
            names += [roles["lse"]] + ([saved_mask_name(roles["lse"])] if program.saves_mask else [])
        for t in names:  # the attention backward names its statistics twice (a read and a role)
            if t not in written and t not in needed and t not in given:
                needed.append(t)
        written.update(step.writes)
    grads = set(face.grad_outputs.values())
    forward_names = set()
    for launcher in program.forward_steps:
        forward_names.update(launcher.step.writes)
        forward_names.update(copy_name(t, l) for t, l in launcher.step.reads.items())
        if launcher.step.kind == ATTENTION_FORWARD:
            forward_names.update((launcher.lse, saved_mask_name(launcher.lse)) if program.saves_mask else (launcher.lse,))
    return [t for t in needed if t not in grads and t in forward_names]


def _inputs(program: LayerProgram, inputs: list[torch.Tensor]) -> dict:
    face = program.interface
    names = face.activations + face.parameters + face.constants
    if len(inputs) != len(names):
        raise TypeError(f"expected {len(names)} tensors {names}, got {len(inputs)}")
    return {t: program.to_spec(t, x, t) if t in face.activations else x for t, x in zip(names, inputs)}


def _unaliased(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Custom ops may not return tensors sharing memory: later ones that do are copied."""
    seen, result = set(), []
    for t in tensors:
        key = t.untyped_storage().data_ptr()
        result.append(t.clone() if key in seen and t.numel() else t)
        seen.add(key)
    return result


@torch.library.custom_op("datamove::layer_forward", mutates_args=())
def layer_forward(program: str, seed: torch.Tensor, inputs: list[torch.Tensor],
                  key_padding_mask: torch.Tensor | None) -> list[torch.Tensor]:
    """The forward steps: returns the outputs (PyTorch order), then ``program.kept``."""
    prog = PROGRAMS[program]
    store = prog.forward(_inputs(prog, inputs), Run(seed, key_padding_mask))
    outputs = [prog.to_torch(t, prog.leaving_value(store, t)) for t in prog.interface.outputs]
    return _unaliased(outputs + [store[t] for t in prog.kept])


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
    face = prog.interface
    store = {**_inputs(prog, inputs), **dict(zip(prog.kept, kept))}
    for t, grad in zip(face.outputs, grads):
        store[face.grad_outputs[t]] = prog.to_spec(t, grad, f"gradient of {t}")
    prog.backward(store, Run(seed, key_padding_mask))
    result = [prog.to_torch(t, prog.leaving_value(store, face.input_grads[t])) if t in face.activations
              else prog.leaving_value(store, face.input_grads[t]) for t in face.activations + face.parameters]
    for stacked in prog.stacked:
        result = stacked.returned(result)
    return _unaliased(result)


@layer_backward.register_fake
def _(program, seed, inputs, kept, grads, key_padding_mask):
    prog = PROGRAMS[program]
    return [torch.empty_strided(shape, stride, dtype=dtype, device=inputs[0].device)
            for shape, stride, dtype in prog.backward_meta()]


def _setup_context(ctx, inputs, output):
    program, seed, tensors, key_padding_mask = inputs
    prog = PROGRAMS[program]
    ctx.program = program
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
    prog = PROGRAMS[ctx.program]
    inputs, kept, has_mask = ctx.counts
    saved = ctx.saved_tensors
    seed, tensors, kept_tensors_ = saved[0], list(saved[1:1 + inputs]), list(saved[1 + inputs:1 + inputs + kept])
    mask = saved[-1] if has_mask else None
    outputs = len(prog.interface.outputs)
    result = list(layer_backward(ctx.program, seed, tensors, kept_tensors_, _output_grads(prog, grads[:outputs], tensors[0].device),
                                 mask))
    for stacked in prog.stacked:
        result = stacked.views(result)
    constants = len(prog.interface.constants)
    return None, None, result + [None] * constants, None


torch.library.register_autograd("datamove::layer_forward", _backward, setup_context=_setup_context)


class TunedLayer(torch.nn.Module):
    """The tuned layer.  ``forward(*activations, key_padding_mask=None)``: activations in their
    PyTorch order (``interface.torch_order``), of exactly the tuned shapes, dtype and device;
    ``key_padding_mask``: optional bool (batch, keys), True = key excluded (the fused attention
    applies it; a plan without one refuses it).  Returns the layer output(s) in PyTorch order."""

    def __init__(self, plan: Plan, graph, operators, interface: TensorInterface, dtype: torch.dtype, device):
        super().__init__()
        self.plan, self.graph, self.operators, self.interface = plan, graph, operators, interface
        self.dtype, self.device_ = dtype, torch.device(device)
        self._programs: dict[bool, LayerProgram] = {}
        self.has_attention = any(s.kind == ATTENTION_FORWARD for s in plan.steps)
        self._allocate_parameters()

    def _allocate_parameters(self) -> None:
        """Parameters and constants in the plan's layouts (stacked groups as one storage), initialised."""
        store: dict = {}
        buffers = self.program(True).buffers
        for t in self.interface.parameters:
            self.register_parameter(t, torch.nn.Parameter(buffers.allocate(store, t, self.plan.layouts[t])))
        for t in self.interface.constants:
            self.register_buffer(t, buffers.allocate(store, t, self.plan.layouts[t]))
        self.reset_parameters()

    def sibling(self) -> "TunedLayer":
        """Another layer of the same plan (its own parameters), sharing this one's compiled programs."""
        twin = TunedLayer.__new__(TunedLayer)
        torch.nn.Module.__init__(twin)
        twin.__dict__.update({k: v for k, v in self.__dict__.items() if k not in ("_parameters", "_buffers", "_modules")})
        twin._allocate_parameters()
        return twin

    def program(self, training: bool) -> LayerProgram:
        if training not in self._programs:
            graph = self.graph if training else without_dropout(self.graph)
            self._programs[training] = LayerProgram(self.plan, graph, self.operators, self.interface, self.dtype,
                                                    self.device_)
            register(self._programs[training])
        return self._programs[training]

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Weights N(0, 1/fan-in) over their contracted letters' extent is unknown here: every
        parameter N(0, 0.02^2) (BERT's initialiser), one-letter ones (biases, norm gains/shifts)
        0 and 1 by name (``gamma``/``gain`` -> 1)."""
        for name, param in self.named_parameters():
            if param.dim() > 1:
                param.normal_(0.0, 0.02)
            else:
                param.fill_(1.0 if any(s in name for s in ("gamma", "gain")) else 0.0)

    def _check_mask(self, mask: torch.Tensor) -> None:
        letters = next(s for s in self.plan.steps if s.kind == ATTENTION_FORWARD).config["letters"]
        expected = (self.graph.size(letters["batch"]), self.graph.size(letters["keys"]))
        check(mask, "key_padding_mask", expected, torch.bool, self.device_, letters["batch"] + letters["keys"])

    def forward(self, *activations, key_padding_mask: torch.Tensor | None = None):
        face = self.interface
        if len(activations) != len(face.activations):
            raise TypeError(f"expected {len(face.activations)} activation(s) {face.activations}, got {len(activations)}")
        if key_padding_mask is not None:
            if not self.has_attention:
                raise ValueError("key_padding_mask: this plan runs no fused attention to apply it")
            self._check_mask(key_padding_mask)
        program = self.program(self.training)
        for t, x in zip(face.activations, activations):  # here too: a meta or fake tensor skips the op's own check
            check(x, t, program.shape(t, face.torch_order[t]), self.dtype, self.device_, face.torch_order[t])
        seed = torch.randint(0, SEED_RANGE, (1,), device=self.device_)  # graph-safe: a new key per replay
        tensors = [*activations, *(getattr(self, t) for t in face.parameters + face.constants)]
        outputs = layer_forward(program.name, seed, tensors, key_padding_mask)[:len(face.outputs)]
        return outputs[0] if len(outputs) == 1 else tuple(outputs)

