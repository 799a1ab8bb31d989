"""``TunedLayer``: the exported layer as a ``torch.nn.Module``.

One ``torch.autograd.Function`` (``LayerFunction``) runs a ``datamove.layer.LayerProgram``'s
forward steps and, on ``backward``, its backward steps.  The module holds the parameters (shape:
spec letter order; storage: the plan's layouts; a stacked group such as Q/K/V's weights is one
storage, so the stacked GEMM reads it without a copy) and the constants (buffers), and keeps two
programs: training (the spec's dropout) and evaluation (dropout off), compiled on first use.
"""
from __future__ import annotations

import torch

from datamove.layer import SEED_RANGE, LayerProgram, TensorInterface, check, without_dropout
from datamove.steps import Run, copy_name, saved_mask_name
from layouts.plan import ATTENTION_FORWARD, Plan


class LayerFunction(torch.autograd.Function):
    """``apply(program, run, *inputs)`` with inputs = activations (PyTorch order), parameters,
    constants (``TensorInterface`` order) -> the outputs (PyTorch order)."""

    @staticmethod
    def forward(ctx, program: LayerProgram, run: Run, *inputs):
        face = program.interface
        names = face.activations + face.parameters + face.constants
        store = {t: program.to_spec(t, x, t) if t in face.activations else x for t, x in zip(names, inputs)}
        program.forward(store, run)
        kept = [t for t in backward_reads(program) if t in store]
        ctx.program, ctx.run, ctx.kept = program, run, kept
        ctx.save_for_backward(*(store[t] for t in kept))
        outputs = tuple(program.to_torch(t, store[t]) for t in face.outputs)
        return outputs if len(outputs) > 1 else outputs[0]

    @staticmethod
    def backward(ctx, *grads):
        program, face = ctx.program, ctx.program.interface
        store = dict(zip(ctx.kept, ctx.saved_tensors))
        for t, grad in zip(face.outputs, grads):
            store[face.grad_outputs[t]] = program.to_spec(t, grad, f"gradient of {t}")
        program.backward(store, ctx.run)
        result = []
        for t in face.activations + face.parameters:
            grad = store[face.input_grads[t]]
            result.append(program.to_torch(t, grad) if t in face.activations else grad)
        return (None, None, *result, *([None] * len(face.constants)))


def backward_reads(program: LayerProgram) -> list[str]:
    """What the backward steps read that they do not write themselves: the tensors (and
    layout-change copies, attention statistics) the forward must keep."""
    written, needed = set(), []
    for launcher in program.backward_steps:
        step = launcher.step
        names = [copy_name(t, layout) if layout != program.layouts.get(t, layout) else t for t, layout in step.reads.items()]
        names += list(step.reads)
        roles = step.config.get("roles", {})
        if roles.get("lse"):
            names += [roles["lse"], saved_mask_name(roles["lse"])]
        needed += [t for t in names if t not in written and t not in needed]
        written.update(step.writes)
    for launcher in program.forward_steps:  # statistics the forward writes beyond the graph's tensors
        if launcher.step.kind == ATTENTION_FORWARD:
            needed += [t for t in (launcher.lse, saved_mask_name(launcher.lse)) if t not in needed]
    return needed


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
        run = Run(int(torch.randint(0, SEED_RANGE, (1,)).item()), key_padding_mask)
        parameters = [getattr(self, t) for t in face.parameters]
        constants = [getattr(self, t) for t in face.constants]
        return LayerFunction.apply(program, run, *activations, *parameters, *constants)

