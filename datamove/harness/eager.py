"""PyTorch eager baseline: the unfused operators a fused one replaces, as a PyTorch user writes them.

``eager_plan(training, op)`` turns the primitives of fused operator ``op`` into a sequence of
eager calls (``Step``s); ``EagerRun`` executes it on bf16 tensors, one PyTorch call after another
(what ``harness.bench.time_cuda`` times).  The closed forms that ``dataflow.autodiff`` recognised
structurally (recorded in ``dataflow.snapshot``) become PyTorch's own kernels:

- softmax forward core -> ``torch.softmax(x, dim)``;
- layernorm forward core, with its affine tail ``* gamma + beta`` when the operator holds it ->
  ``torch.native_layer_norm(x, shape, gamma, beta, eps)`` (what ``F.layer_norm`` calls; it saves
  mean and 1/std for the backward instead of datamove's xhat and std);
- softmax backward (``y * (g - sum(g * y))``) -> ``aten._softmax_backward_data(g, y, dim, dtype)``;
- layernorm backward -> ``aten.native_layer_norm_backward(g, x, shape, mean, rstd, gamma, ...)``
  (dx only; with the gradient's ``* gamma`` folded in when the operator holds it); it reads the
  forward input x and the saved mean / rstd, as eager autograd does;
- a map ``in0 * in1`` by a dropout mask -> ``aten.native_dropout_backward(x, keep, dropout_scale(p))``
  (a multiply by the stored boolean mask, as eager autograd does in backward);
- every other map: its expression with torch element-wise operations (bias, ReLU, residual,
  GELU written out, as HuggingFace's GPT-2 does), one kernel per operation; reductions (bias
  gradients) ``.sum`` / ``.amax`` over the reduced dims; a shuffle (``dataflow.shuffle``:
  rotate_half's ``torch.cat((-x2, x1), -1)``) ``index_select`` at the moved index times the factors.

Eager tensors are stored as a PyTorch user stores them: the letters that the operator's
softmax / layernorm normalise over innermost (features last), the others in spec order
(``eager_layout``); they are handed around as views in spec letter order.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from datamove.dataflow.shuffle import shuffle_of
from datamove.kernels.philox import dropout_scale
from datamove.harness.torch_eval import map_value, reduce_value

aten = torch.ops.aten


@dataclass(frozen=True)
class Step:
    """One eager call.  ``kind``: "softmax", "layernorm", "softmax_backward", "layernorm_backward",
    "dropout" or "primitive"; ``prims``: the primitives it stands for; ``form``: the closed form
    (``dataflow.snapshot.ClosedForm``) of the first four kinds; ``affine``: layernorm's
    (gamma, beta) tensors folded in (backward: gamma only, beta None); ``output``: what it writes."""

    kind: str
    prims: tuple
    output: str
    form: object = None
    affine: tuple | None = None


def _is_product(prim) -> bool:
    return prim.kind == "map" and prim.expression.matches("in0 * in1", "in1 * in0")


def _is_sum(prim) -> bool:
    return prim.kind == "map" and prim.expression.matches("in0 + in1", "in1 + in0")


def _over(operand, reference, reduced_positions) -> bool:
    """``operand`` (a gamma / beta) indexes exactly ``reference``'s letters at the reduced positions."""
    return set(operand.letters) == {reference.letters[n] for n in reduced_positions}


def eager_plan(training, op) -> list[Step]:
    """The eager calls replacing fused operator ``op`` of ``training`` (a ``FusedTraining``)."""
    graph = training.graph
    prims = {p.name: p for p in op.primitives}
    consumers = {}
    for p in op.primitives:
        for o in p.inputs:
            consumers.setdefault(o.tensor, []).append(p)
    producer = {p.output.tensor: p for p in op.primitives}
    claimed: dict[str, Step] = {}

    def reduced_positions(tensor: str, form) -> list[int]:
        return [graph.tensors[tensor].letters.index(l) for l in form.reduced]

    for form in training.closed_forms:
        if set(form.forward) <= set(prims):
            names, output, affine = list(form.forward), form.output, None
            if form.kind == "layernorm":
                users = consumers.get(form.output, [])
                if len(users) == 1 and _is_product(users[0]):
                    mul = users[0]
                    x_op = next(o for o in mul.inputs if o.tensor == form.output)
                    gamma = next(o for o in mul.inputs if o.tensor != form.output)
                    adds = consumers.get(mul.output.tensor, [])
                    pos = reduced_positions(form.output, form)
                    if (_over(gamma, x_op, pos) and len(adds) == 1 and _is_sum(adds[0])
                            and mul.output.tensor not in op.outputs):
                        beta = next(o for o in adds[0].inputs if o.tensor != mul.output.tensor)
                        if _over(beta, mul.output, pos):
                            names += [mul.name, adds[0].name]
                            output, affine = adds[0].output.tensor, (gamma.tensor, beta.tensor)
            step = Step(form.kind, tuple(names), output, form, affine)
            claimed.update(dict.fromkeys(names, step))
        if form.backward and set(form.backward) <= set(prims):
            names, affine = list(form.backward), None
            first = prims[form.backward[0]]
            if form.kind == "layernorm":
                g = first.inputs[0]
                made = producer.get(g.tensor)
                if made is not None and _is_product(made) and g.tensor not in op.outputs and made.name not in claimed:
                    gamma = next((o for o in made.inputs if graph.tensors[o.tensor].role == "input"
                                  and _over(o, g, reduced_positions(form.output, form))), None)
                    if gamma is not None:
                        names.insert(0, made.name)
                        affine = (gamma.tensor, None)
            step = Step(f"{form.kind}_backward", tuple(names), prims[form.backward[-1]].output.tensor, form, affine)
            claimed.update(dict.fromkeys(names, step))
    steps, emitted = [], set()
    for prim in op.primitives:
        step = claimed.get(prim.name)
        if step is None:
            dropout = _is_product(prim) and sum(graph.tensors[o.tensor].role == "dropout" for o in prim.inputs) == 1
            step = Step("dropout" if dropout else "primitive", (prim.name,), prim.output.tensor)
        if step.prims not in emitted:
            emitted.add(step.prims)
            steps.append(step)
    return steps


def normalised_letters(training, op) -> str:
    """Spec letters that the closed forms held (forward or backward) by ``op`` normalise over."""
    names = {p.name for p in op.primitives}
    return "".join(dict.fromkeys(l for f in training.closed_forms
                                 if set(f.forward) & names or set(f.backward) & names for l in f.reduced))


def eager_layout(letters: str, last: str) -> str:
    """A tensor's eager storage order: its letters in spec order, those in ``last`` moved innermost."""
    return "".join(l for l in letters if l not in last) + "".join(l for l in letters if l in last)


def eager_inputs(training, steps: list[Step], op) -> list[str]:
    """Tensors the eager steps read that they do not write: the operator's inputs, plus, for a
    layernorm backward, the forward input x (mean / rstd are derived from it)."""
    graph = training.graph
    prims = {p.name: p for p in op.primitives}
    written, needed = set(), []
    for step in steps:
        reads = []
        if step.kind == "layernorm_backward":
            first = prims[step.prims[0]]
            reads = [first.inputs[0].tensor if step.affine is None else
                     next(o.tensor for o in first.inputs if o.tensor != step.affine[0]), step.form.input]
            reads += [step.affine[0]] if step.affine else []
        else:
            reads = [o.tensor for n in step.prims for o in prims[n].inputs]
        for t in reads:
            if t not in written and t not in needed and t in graph.tensors:
                needed.append(t)
        written.update(prims[n].output.tensor for n in step.prims)
    return needed


class EagerRun:
    """The eager sequence of ``op`` bound to bf16 inputs.  ``values``: {tensor: float64 value in
    spec order} (at least the tensors of ``eager_inputs``); ``mask_keep``: {dropout tensor:
    boolean keep mask}.  Setup (not timed) stores the inputs in ``eager_layout`` and computes
    layernorm's saved mean / rstd; ``__call__`` runs the steps and returns {tensor: result}."""

    def __init__(self, training, op, values: dict, mask_keep: dict, dtype=torch.bfloat16):
        self.graph, self.op, self.dtype = training.graph, op, dtype
        self.steps = eager_plan(training, op)
        self.prims = {p.name: p for p in op.primitives}
        last = normalised_letters(training, op)
        self.inputs = {}
        for t in eager_inputs(training, self.steps, op):
            info = self.graph.tensors[t]
            if info.role == "dropout":
                self.inputs[t] = mask_keep[t]
                continue
            layout = eager_layout(info.letters, last)
            store = values[t].permute([info.letters.index(l) for l in layout]).to(dtype).contiguous()
            self.inputs[t] = store.permute([layout.index(l) for l in info.letters])
        self.saved = {}
        for step in self.steps:
            if step.kind == "layernorm_backward":
                x, shape = self._features_last(self.inputs[step.form.input], step.form)
                _, mean, rstd = aten.native_layer_norm(x, shape, None, None, step.form.eps)
                self.saved[step] = (mean, rstd)

    def _order(self, form) -> list[int]:
        """Axes of the form's tensors (x, y and their gradients share x's axis order), normalised ones last."""
        letters = self.graph.tensors[form.input].letters
        return [n for n, l in enumerate(letters) if l not in form.reduced] + [letters.index(l) for l in form.reduced]

    def _features_last(self, x: torch.Tensor, form):
        """``x`` permuted to the normalised axes last, and the normalised shape."""
        order = self._order(form)
        return x.permute(order), list(x.shape[n] for n in order[len(order) - len(form.reduced):])

    def _back(self, y: torch.Tensor, form) -> torch.Tensor:
        """Inverse of ``_features_last``: a features-last result as a view in spec axis order."""
        order = self._order(form)
        return y.permute([order.index(n) for n in range(len(order))])

    def _dim(self, form) -> int:
        (letter,) = form.reduced
        return self.graph.tensors[form.input].letters.index(letter)

    def _param(self, name: str, form) -> torch.Tensor:
        """gamma / beta (letters of the normalised dims) in the form's reduced order."""
        letters = self.graph.tensors[name].letters
        value = self.inputs[name]
        if len(letters) == 1:
            return value
        own_dims = [self.graph.letter_dims[l] for l in letters]
        want = [self.graph.letter_dims[l] for l in form.reduced]
        return value.permute([own_dims.index(d) for d in want]).contiguous()

    def __call__(self) -> dict:
        env = dict(self.inputs)
        graph, prims = self.graph, self.prims
        for step in self.steps:
            form = step.form
            if step.kind == "softmax":
                env[step.output] = torch.softmax(env[form.input], self._dim(form))
            elif step.kind == "layernorm":
                x, shape = self._features_last(env[form.input], form)
                gamma, beta = (self._param(t, form) for t in step.affine) if step.affine else (None, None)
                y, mean, rstd = aten.native_layer_norm(x, shape, gamma, beta, form.eps)
                env[step.output] = self._back(y, form)
            elif step.kind == "softmax_backward":
                first = prims[step.prims[0]]
                g = next(env[o.tensor] for o in first.inputs if o.tensor != form.output)
                env[step.output] = aten._softmax_backward_data(g, env[form.output], self._dim(form), g.dtype)
            elif step.kind == "layernorm_backward":
                first = prims[step.prims[0]]
                g_name = first.inputs[0].tensor if step.affine is None else \
                    next(o.tensor for o in first.inputs if o.tensor != step.affine[0])
                g, shape = self._features_last(env[g_name], form)
                x, _ = self._features_last(env[form.input], form)
                mean, rstd = self.saved[step]
                gamma = self._param(step.affine[0], form) if step.affine else None
                dx, _, _ = aten.native_layer_norm_backward(g, x, shape, mean, rstd, gamma, None, [True, False, False])
                env[step.output] = self._back(dx, form)
            elif step.kind == "dropout":
                prim = prims[step.prims[0]]
                mask = next(o for o in prim.inputs if graph.tensors[o.tensor].role == "dropout")
                x = next(o for o in prim.inputs if o is not mask)
                scale = dropout_scale(graph.tensors[mask.tensor].p)
                keep = env[mask.tensor]
                value = env[x.tensor]
                if x.letters != mask.letters:
                    keep = keep.permute([mask.letters.index(l) for l in x.letters])
                result = aten.native_dropout_backward(value, keep, scale)
                env[step.output] = result.permute([x.letters.index(l) for l in prim.output.letters]) \
                    if x.letters != prim.output.letters else result
            else:
                prim = prims[step.prims[0]]
                arrays = [env[o.tensor] if graph.tensors[o.tensor].role != "dropout" else
                          env[o.tensor].to(self.dtype) * dropout_scale(graph.tensors[o.tensor].p) for o in prim.inputs]
                if prim.kind == "reduce":
                    value = reduce_value(prim, arrays[0])
                elif prim.kind == "map":
                    value = map_value(graph, prim, arrays, self.dtype)
                    if prim.expression.input_index is not None:
                        value = value.clone()  # a copy (transposition), not an alias
                elif (shuffle := shuffle_of(graph, prim)) is not None:
                    x, axis = arrays[shuffle.source], prim.inputs[shuffle.source].letters.index(shuffle.read)
                    index, factor = shuffle.gather(graph.dim_values)
                    shape = [len(factor) if n == axis else 1 for n in range(x.dim())]
                    value = x.index_select(axis, torch.tensor(index, device=x.device)) \
                        * torch.tensor(factor, dtype=x.dtype, device=x.device).reshape(shape)
                else:
                    raise ValueError(f"{prim.name}: contraction inside an element-wise operator")
                env[prim.output.tensor] = value  # its output letters name the tensor's axes in order
        return {t: env[t] for t in env if t not in self.inputs}

