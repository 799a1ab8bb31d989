"""The tuned layer's computation as PyTorch operations: what the layer runs where its kernels cannot.

``TorchProgram`` is a ``datamove.runtime.layer.LayerProgram`` in behaviour (the same calls, the same
results up to rounding) without a kernel: the training graph's primitives (``dataflow.graph``)
evaluated with torch (``harness.torch_eval``: the reference executor's semantics), the forward
operators' primitives then the backward's, operator by operator in the fused graph's order.  On a
machine without a GPU this is the layer (``datamove.runtime.module.TunedLayer``'s default backend there);
the Triton interpreter remains what the kernel tests use.

Precision: every primitive computes in float32 (float64 for a float64 layer); activations, outputs
and gradients cross the boundary in the layer's dtype.  So a bf16 or fp16 layer on the CPU
computes as the GPU kernels do (fp32 inside, rounded where it leaves), never through the Triton
interpreter's bf16 arithmetic.

Dropout: the masks are the kernels' (``dataflow.dropout_mask``: Philox from the call's seed at each
mask's ``dataflow.executor.dropout_offsets`` offset), so a call reproduces the GPU layer's mask and
the float64 executor's; the forward returns the masks the backward reads (bool) with the other
tensors it keeps.  A ``key_padding_mask`` (bool (batch, keys), True = key excluded) sets the
excluded keys' scores, as the score contraction writes them, to the dtype's lowest value, as the
fused attention excludes them.
"""
from __future__ import annotations

import torch

from datamove.dataflow.dropout_mask import dropout_scale, keep_mask
from datamove.dataflow.executor import dropout_offsets
from datamove.harness.torch_eval import run_primitive
from datamove.layouts.plan import ATTENTION_FORWARD, Plan
from datamove.runtime.call_constants import ConstantsAtCall


def _dead_after(primitives: list, needed: set) -> list[tuple[str, ...]]:
    """Per primitive, the tensors it reads or writes that no later one reads and ``needed`` (read
    after the run) does not hold."""
    drops, later = [], set(needed)
    for prim in reversed(primitives):
        touched = [o.tensor for o in prim.inputs] + [prim.output.tensor]
        drops.append(tuple(dict.fromkeys(t for t in touched if t not in later)))
        later.update(o.tensor for o in prim.inputs)
    return drops[::-1]


def _shared(value: torch.Tensor, env: dict, name: str | None = None) -> bool:
    """Whether a tensor of ``env`` (other than ``name``) shares ``value``'s memory."""
    storage = value.untyped_storage().data_ptr()
    return any(k != name and v is not None and v.untyped_storage().data_ptr() == storage for k, v in env.items())


def _let_go(free: dict, value: torch.Tensor) -> None:
    """``value`` into the pool ``free`` ((shape, dtype) -> tensors whose memory a map may write)."""
    free.setdefault((tuple(value.shape), value.dtype), []).append(value)


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """What the primitives compute in for a layer of ``dtype``: float64 for float64, else float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


class TorchProgram:
    """A plan's computation for one graph, dtype and device, in PyTorch operations (module doc).

    ``kept``: what the forward returns besides the outputs for the backward (forward tensors it
    reads, spec order, compute dtype; dropout masks as bool), named as ``LayerProgram.kept``;
    ``held``: as ``LayerProgram``'s (the constants read at the call's sizes: ``at_call``)."""

    stacked: list = []  # no stacked gradient buffers: each parameter gets its own gradient
    causal_constants: list = []  # a causal constant is read as the spec reads it, not replaced
    at_call = None  # constants read at the call's sizes (set per program; programs pickled before it: none)

    def __init__(self, plan: Plan, graph, operators, interface, dtype: torch.dtype, device, held: dict | None = None):
        self.plan, self.graph, self.interface, self.dtype = plan, graph, interface, dtype
        self.device, self.compute = torch.device(device), compute_dtype(dtype)
        at_call = ConstantsAtCall(graph, interface, held, plan.layouts, self.compute, self.device, dense=False)
        self.at_call = at_call if at_call else None  # constants read at the call's sizes (``LayerProgram``'s)
        self.name = ""  # the custom ops' name for it: set by datamove.runtime.module.register
        self.forward_primitives = [p for op in operators if op.phase == "forward" for p in op.primitives]
        self.backward_primitives = [p for op in operators if op.phase != "forward" for p in op.primitives]
        self.offsets = dropout_offsets(graph)
        face = interface
        given = set(face.activations + face.parameters + face.constants + tuple(face.grad_outputs.values()))
        written, kept = set(), []
        for prim in self.backward_primitives:
            for operand in prim.inputs:
                t = operand.tensor
                if t not in written and t not in given and t not in kept:
                    kept.append(t)
            written.add(prim.output.tensor)
        self.kept = kept
        self._forward_drops = _dead_after(self.forward_primitives, set(face.outputs) | set(kept))
        self._backward_drops = _dead_after(self.backward_primitives, set(face.input_grads.values()))
        self.torch_shapes = {t: self.shape(t, order) for t, order in face.torch_order.items()}
        self._to_spec_axes = {t: [order.index(x) for x in graph.tensors[t].letters] for t, order in face.torch_order.items()}
        self.scores = self._scores(plan)

    def shape(self, tensor: str, order: str | None = None) -> tuple[int, ...]:
        """The tensor's shape in ``order`` (default: its spec letter order)."""
        return tuple(self.graph.size(letter) for letter in (order or self.graph.tensors[tensor].letters))

    def _scores(self, plan: Plan) -> tuple[str, int, int] | None:
        """(the scores tensor the fused attention's score contraction writes, its batch axis, its
        keys axis): where a ``key_padding_mask`` applies; None without a fused attention."""
        step = next((s for s in plan.steps if s.kind == ATTENTION_FORWARD), None)
        if step is None:
            return None
        roles, letters = step.config.roles, step.config.letters
        # with grouped-query attention the scores read k repeated over the query heads, not the role's K
        names = {"q": roles["q"], "k": ((step.config.groups or {}).get("repeated") or {}).get("k", roles["k"])}
        for prim in self.forward_primitives:
            tensors = [o.tensor for o in prim.inputs]
            if prim.kind != "einsum" or sorted(tensors) != sorted(names.values()):
                continue
            q, k = (prim.inputs[tensors.index(names[r])] for r in ("q", "k"))
            batch = q.letters[self.graph.tensors[q.tensor].letters.index(letters["batch"])]
            keys = k.letters[self.graph.tensors[k.tensor].letters.index(letters["keys"])]
            return prim.output.tensor, prim.output.letters.index(batch), prim.output.letters.index(keys)
        return None

    def _masks(self, seed: int) -> dict[str, torch.Tensor]:
        """The keep masks (bool, spec order) of the dropout tensors that drop anything."""
        return {name: torch.from_numpy(keep_mask(seed, offset, self.shape(name), self.graph.tensors[name].p)).to(self.device)
                for name, offset in self.offsets.items() if self.graph.tensors[name].p > 0}

    def _multiplier(self, name: str, keep: torch.Tensor | None) -> torch.Tensor:
        """A dropout tensor's multipliers (0 or ``dropout_scale(p)``; ones where ``p`` is 0)."""
        if keep is None:
            return torch.ones((), dtype=self.compute, device=self.device).expand(self.shape(name))
        return keep.to(self.compute).mul_(dropout_scale(self.graph.tensors[name].p))

    def _run(self, primitives, drops: list, env: dict, keeps: dict, key_padding_mask: torch.Tensor | None = None) -> dict:
        """Evaluate ``primitives`` in order on ``env`` (spec-order tensors in the compute dtype),
        letting go of each tensor nothing reads later (``drops[n]``: after primitive ``n``).  A
        map writes into the memory of a tensor this run made and let go (or of its own operand
        that dies with it) where its shape allows (``harness.torch_eval.map_value``'s ``into``):
        large tensors are fresh memory less often (on a 2-core VM a fresh 134 MB tensor cost up to
        0.2 s of page faults).  Tensors from outside (the caller's, the forward's kept ones) are
        never written."""
        made: set[str] = set()  # tensors this run wrote (or a dropout multiplier it made)
        free: dict[tuple, list] = {}  # (shape, dtype) -> contiguous tensors let go, nothing else sharing them
        for prim, dead in zip(primitives, drops):
            for operand in prim.inputs:
                if operand.tensor not in env:  # a dropout mask, first read
                    env[operand.tensor] = self._multiplier(operand.tensor, keeps.get(operand.tensor))
                    made.add(operand.tensor)
            into, pooled = self._buffer(prim, dead, env, made, free) if prim.kind == "map" else (None, False)
            value = run_primitive(self.graph, prim, env, self.compute, into=into)
            if pooled and value.data_ptr() != into.data_ptr():
                _let_go(free, into)  # not written: back to the pool
            if key_padding_mask is not None and self.scores and prim.output.tensor == self.scores[0]:
                _, batch, keys = self.scores
                shape = [1] * value.dim()
                shape[batch], shape[keys] = key_padding_mask.shape
                value = value.masked_fill(key_padding_mask.view(shape), torch.finfo(self.compute).min)
            env[prim.output.tensor] = value.contiguous()
            made.add(prim.output.tensor)
            for t in dead:
                value = env.pop(t, None)
                if t in made and value is not None and value.is_contiguous() and not _shared(value, env):
                    _let_go(free, value)
        return env

    def _buffer(self, prim, dead: tuple, env: dict, made: set, free: dict) -> tuple[torch.Tensor | None, bool]:
        """(memory for ``prim``'s output, whether it came from ``free``): an operand that this run
        made and that dies with ``prim``, read over the output's letters wherever ``prim`` reads it
        (nothing else sharing it), else a tensor let go before of the output's shape, else None (fresh)."""
        shape = self.shape(prim.output.tensor)
        for t in dict.fromkeys(o.tensor for o in prim.inputs):
            value = env.get(t)
            if (t in dead and t in made and all(o.letters == prim.output.letters for o in prim.inputs if o.tensor == t)
                    and value.is_contiguous() and tuple(value.shape) == shape and value.dtype == self.compute
                    and not _shared(value, env, t)):
                return value, False
        pool = free.get((shape, self.compute))
        return (pool.pop(), True) if pool else (None, False)

    def _inputs(self, inputs: list[torch.Tensor]) -> dict:
        """The activations (PyTorch order), parameters and constants (as the layer holds them, read at
        the call's sizes: ``at_call``) as spec-order compute-dtype tensors."""
        face = self.interface
        names = face.activations + face.parameters + face.constants
        if len(inputs) != len(names):
            raise TypeError(f"expected {len(names)} tensors {names}, got {len(inputs)}")
        env = {t: (x.permute(self._to_spec_axes[t]) if t in face.activations else x).to(self.compute)
               for t, x in zip(names, inputs)}
        return env if self.at_call is None else self.at_call.take(env)

    def _leaving(self, tensor: str, value: torch.Tensor) -> torch.Tensor:
        """A spec-order result as PyTorch receives it: ``tensor``'s torch order, the layer's dtype, contiguous."""
        letters = self.graph.tensors[tensor].letters
        order = self.interface.torch_order[tensor]
        return value.permute([letters.index(x) for x in order]).to(self.dtype).contiguous()

    def _as_written(self):
        """The steps in the program's compute dtype whatever autocast region calls the layer (an AMP
        loop's ``torch.autocast``): the kernels backend's Triton kernels ignore autocast too (under it,
        bf16 scores met a float32 fill value and the padded call failed)."""
        return torch.autocast(self.device.type, enabled=False)

    def call_forward(self, inputs: list[torch.Tensor], run) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The forward on ``inputs`` (activations, parameters, constants): (the outputs in PyTorch
        order, the ``kept`` tensors)."""
        if self.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("datamove: the torch backend draws its dropout masks on the host and cannot run inside "
                               "a CUDA graph capture; capture the layer with its kernels (backend='kernels')")
        env = self._inputs(inputs)
        keeps = self._masks(int(run.seed))
        with self._as_written():
            self._run(self.forward_primitives, self._forward_drops, env, keeps, run.key_padding_mask)
        outputs = [self._leaving(t, env[t]) for t in self.interface.outputs]
        nothing_dropped = torch.empty(0, dtype=torch.bool, device=self.device)  # a kept mask of probability 0
        kept = [keeps[t] if t in keeps else nothing_dropped if self.graph.tensors[t].role == "dropout" else env[t]
                for t in self.kept]
        return outputs, kept

    def call_backward(self, inputs: list[torch.Tensor], kept: list[torch.Tensor], grads: list[torch.Tensor],
                      run) -> list[torch.Tensor]:
        """The backward from ``call_forward``'s ``kept`` and the outputs' gradients (PyTorch order):
        the gradients of the activations (PyTorch order) and of the parameters (spec order), in the
        layer's dtype."""
        face = self.interface
        env = self._inputs(inputs)
        keeps = {}
        for t, value in zip(self.kept, kept):
            if self.graph.tensors[t].role == "dropout":
                if value.numel():
                    keeps[t] = value
            else:
                env[t] = value
        for t, grad in zip(face.outputs, grads):
            env[face.grad_outputs[t]] = grad.permute(self._to_spec_axes[t]).to(self.compute)
        with self._as_written():
            self._run(self.backward_primitives, self._backward_drops, env, keeps)
        return [self._leaving(t, env[face.input_grads[t]]) if t in face.activations
                else env[face.input_grads[t]].to(self.dtype) for t in face.activations + face.parameters]

    def _contiguous(self, shape: tuple, dtype: torch.dtype) -> tuple[tuple, tuple, torch.dtype]:
        return tuple(shape), tuple(torch.empty(shape, device="meta").stride()), dtype

    def forward_meta(self) -> list[tuple[tuple, tuple, torch.dtype]]:
        """(shape, strides, dtype) of ``call_forward``'s results: the outputs, then ``kept``."""
        result = [self._contiguous(self.torch_shapes[t], self.dtype) for t in self.interface.outputs]
        for t in self.kept:
            info = self.graph.tensors[t]
            if info.role == "dropout":
                result.append(self._contiguous(self.shape(t) if info.p > 0 else (0,), torch.bool))
            else:
                result.append(self._contiguous(self.shape(t), self.compute))
        return result

    def backward_meta(self) -> list[tuple[tuple, tuple, torch.dtype]]:
        """(shape, strides, dtype) of ``call_backward``'s results."""
        face = self.interface
        return [self._contiguous(self.torch_shapes[t] if t in face.activations else self.shape(t), self.dtype)
                for t in face.activations + face.parameters]
