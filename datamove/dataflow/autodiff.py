"""Reverse-mode derivation of the training graph from a forward ``PrimitiveGraph``.

Every forward primitive is differentiated from its kind and expression, never from a model's
names:

- einsum ``"A,B->C"``: the gradient of each operand is the einsum with that operand's term
  replaced by the output's (``"phi,ibj->phbj"`` gives dW ``"phbj,ibj->phi"`` and dX
  ``"phi,phbj->ibj"``);
- map: the chain rule on the expression's tree (``dataflow.expression``'s ``derivative``: symbolic
  derivative of +, -, *, /, **, exp, log, sqrt, tanh, log1p, expm1, abs, sign (0),
  maximum/minimum (a mask, ReLU's ``in0 > 0``), where);
  an operand broadcast over letters of the output gets its gradient summed over them (bias
  gradients become reductions); a dropout is a multiplication by its mask tensor, so its backward
  multiplies by the same mask;
- reduce: sum broadcasts the gradient back, max routes it to the maxima;
- an element-wise operator of several maps (GELU written out) is inlined into one expression
  first (``dataflow.derivatives.elementwise_chains``), so its backward is one map reading the
  operator's inputs, not its inner tensors;
- a softmax or layernorm recognised inside a forward normalization operator
  (``dataflow.closed_forms``) is differentiated in closed form.

The derived graph is then rewritten so that ReLU's backward reads what the forward saves anyway
(``relu_masks_from_outputs``): ``d_x = d_y * (x > 0)`` for ``y = maximum(x, 0)`` becomes
``d_x = d_y * (y > 0)``, and through a dropout ``h = y * mask``, ``d_x = d_h * (h > 0) * scale``;
the forward then need not save x, and the backward need not regenerate the mask.

A tensor read by several primitives (residual connections, Q/K/V sharing x) receives one
gradient contribution per reader; they are summed by one n-ary map ``in0 + in1 + ...``.
Gradient tensors are named ``d_<tensor>`` and stored in the order of ``<tensor>``'s letters;
single contributions that are identities (a residual's ``+``) alias the incoming gradient
instead of copying it, except for an input (a parameter read only through ``1 + w``, Gemma's
RMSNorm weight), whose gradient is copied under its own name, as the layer's interface reads it.
"""
from __future__ import annotations

from dataclasses import dataclass

from datamove.dataflow.closed_forms import ClosedForm, recognise_normalizations
from datamove.dataflow.derivatives import elementwise_chains
from datamove.dataflow.expression import ONE, ZERO, Input, add, product
from datamove.dataflow.graph import SCALE_PREFIX, Operand, Primitive, PrimitiveGraph, TensorInfo
from datamove.dataflow.operators import BACKWARD, FORWARD, Operator, group_operators, make_operator


@dataclass
class TrainingGraph:
    """Forward and backward primitives of one training step, in one topological order.

    ``graph.tensors`` adds, for every forward output ``y``, the incoming gradient ``d_y`` (role
    "grad_output", an input of the training step, listed in ``seeds``) and the backward tensors
    (role "gradient" for the gradients of layer inputs, which with the forward outputs are
    ``graph.outputs``).  ``grads`` maps each forward tensor that receives a gradient to the tensor
    holding it; ``derived`` maps each forward primitive to the backward primitives derived from it.
    """

    graph: PrimitiveGraph
    phases: dict[str, str]
    grads: dict[str, str]
    seeds: dict[str, str]
    derived: dict[str, tuple[str, ...]]
    closed_forms: list[ClosedForm]

    def primitives(self, phase: str) -> list[Primitive]:
        return [p for p in self.graph.primitives if self.phases[p.name] == phase]

    def subgraph(self, phase: str) -> PrimitiveGraph:
        """The primitives of one phase over all tensors (the other phase's tensors become inputs)."""
        return PrimitiveGraph(self.graph.tensors, self.primitives(phase), self.graph.letter_dims,
                              self.graph.dim_values, list(self.graph.outputs))

    @property
    def input_grads(self) -> dict[str, str]:
        """Layer input (role "input") -> the tensor holding its gradient."""
        return {name: self.grads[name] for name, info in self.graph.tensors.items()
                if info.role == "input" and name in self.grads}

    def operators(self) -> list[Operator]:
        """The unfused training operators: forward then backward, each grouped and classified by
        ``group_operators`` on its phase, with inputs and outputs counted in the whole training
        graph (a forward operator also outputs what the backward reads)."""
        result = []
        for phase in (FORWARD, BACKWARD):
            for op in group_operators(self.subgraph(phase), phase):
                result.append(make_operator(self.graph, list(op.primitives), phase, cls=op.cls))
        return result


def build_training_graph(graph: PrimitiveGraph, closed_forms: bool = True, relu_masks: bool = True) -> TrainingGraph:
    """Differentiate ``graph`` (a forward graph) into its training graph.

    ``closed_forms=False`` differentiates normalizations by the generic chain rule through
    max / exp / sum / div (correct but wasteful; kept to cross-check the closed forms);
    ``relu_masks=False`` leaves ReLU's backward reading its input (``relu_masks_from_outputs``).
    """
    training = _Backward(graph, recognise_normalizations(graph) if closed_forms else [], elementwise_chains(graph)).run()
    return relu_masks_from_outputs(training) if relu_masks else training


# --- the backward pass --------------------------------------------------------------------------

class _Backward:
    """Walks the forward primitives in reverse, emitting gradient primitives."""

    def __init__(self, graph: PrimitiveGraph, closed_forms: list[ClosedForm],
                 chains: list[tuple[tuple[str, ...], Primitive]]):
        self.graph = graph
        self.closed_forms = closed_forms
        self.chains = {composed.name: composed for _, composed in chains}
        self.chained = {name for members, _ in chains for name in members[:-1]}
        self.tensors = dict(graph.tensors)
        self.prims: list[Primitive] = []
        self.contributions: dict[str, list[str]] = {}
        self.grads: dict[str, str] = {}
        self.seeds: dict[str, str] = {}
        self.derived: dict[str, tuple[str, ...]] = {}
        self.by_target = {cf.output: cf for cf in closed_forms}
        self.skipped = {name for cf in closed_forms for name in cf.members}
        self.requires = self._requires_grad()
        self.planned = self._planned_contributions()

    # which tensors carry gradients, and how many contributions each will receive
    def _requires_grad(self) -> set[str]:
        requires = {name for name, info in self.graph.tensors.items() if info.role == "input"}
        for prim in self.graph.primitives:
            if any(op.tensor in requires for op in prim.inputs):
                requires.add(prim.output.tensor)
        return requires

    def _emitting(self) -> list[tuple[Primitive, ClosedForm | None]]:
        """Forward primitives that emit backward ones: closed-form targets stand for their core,
        the last map of an element-wise chain for the chain (inlined)."""
        reaches = set(self.graph.outputs)
        for prim in reversed(self.graph.primitives):
            if prim.output.tensor in reaches:
                reaches.update(op.tensor for op in prim.inputs)
        result = []
        for prim in self.graph.primitives:
            if prim.output.tensor not in reaches or prim.output.tensor not in self.requires:
                continue
            core = self.by_target.get(prim.output.tensor)
            if core is None and (prim.name in self.skipped or prim.name in self.chained):
                continue
            result.append((self.chains.get(prim.name, prim), core))
        return result

    def _planned_contributions(self) -> dict[str, int]:
        planned = {name: 1 for name in self.graph.outputs}
        for prim, core in self._emitting():
            targets = [core.input] if core else [op.tensor for op in self._grad_operands(prim)]
            for tensor in targets:
                planned[tensor] = planned.get(tensor, 0) + 1
        return planned

    def _grad_operands(self, prim: Primitive) -> list[Operand]:
        """The operands of ``prim`` that receive one contribution each (maps: one per distinct
        (tensor, letters), as ``x * x`` contributes once), layer inputs (weights) first, so that
        weight gradients precede the gradients they do not need in the backward order."""
        operands = [op for op in prim.inputs if op.tensor in self.requires]
        if prim.kind != "einsum":
            operands = list(dict.fromkeys(operands))
        return sorted(operands, key=lambda op: self.graph.tensors[op.tensor].role != "input")  # weights first

    # emitting
    def _new_tensor(self, name: str, letters: str, role: str = "intermediate") -> str:
        base, n = name, 1
        while name in self.tensors:
            name, n = f"{base}_{n}", n + 1
        self.tensors[name] = TensorInfo(name, letters, role)
        return name

    def _emit(self, kind: str, inputs: list[Operand], output: Operand, expr: str) -> None:
        self.prims.append(Primitive(f"{kind}:{output.tensor}", kind, tuple(inputs), output, expr))

    def _contribution_name(self, tensor: str, via: str) -> str:
        """A new tensor for ``tensor``'s gradient coming through ``via``: ``d_<tensor>`` itself when
        it is the only contribution, else a partial ``d_<tensor>_via_<via>`` to be summed."""
        if self.planned.get(tensor, 0) == 1:
            role = "gradient" if self.graph.tensors[tensor].role == "input" else "intermediate"
            return self._new_tensor(f"d_{tensor}", self.graph.tensors[tensor].letters, role)
        return self._new_tensor(f"d_{tensor}_via_{via}", self.graph.tensors[tensor].letters)

    def _contribute(self, tensor: str, name: str) -> None:
        self.contributions.setdefault(tensor, []).append(name)

    def _finalize(self, tensor: str) -> str | None:
        """The gradient of ``tensor``: its single contribution, or their sum."""
        if tensor in self.grads:
            return self.grads[tensor]
        parts = self.contributions.get(tensor, [])
        if not parts:
            return None
        # one contribution is the gradient itself, except an input's aliasing another gradient (Gemma's
        # 1 + w): copied under the input's name below, the sum of one part being the map "in0"
        if len(parts) == 1 and (self.graph.tensors[tensor].role != "input" or parts[0] == f"d_{tensor}"):
            self.grads[tensor] = parts[0]
            return parts[0]
        letters = self.graph.tensors[tensor].letters
        role = "gradient" if self.graph.tensors[tensor].role == "input" else "intermediate"
        name = self._new_tensor(f"d_{tensor}", letters, role)
        self._emit("map", [Operand(p, letters) for p in parts], Operand(name, letters),
                   " + ".join(f"in{k}" for k in range(len(parts))))
        self.grads[tensor] = name
        return name

    def _einsum(self, prim: Primitive, d_out: str) -> None:
        ins, out = prim.expr.split("->")
        terms = ins.split(",")
        for k, operand in enumerate(prim.inputs):
            if operand.tensor not in self.requires:
                continue
            others = set("".join(t for j, t in enumerate(terms) if j != k) + out)
            if len(set(terms[k])) != len(terms[k]) or not set(terms[k]) <= others:
                raise ValueError(f"{prim.name}: cannot differentiate {prim.expr!r} for operand {k} "
                                 "(a letter repeated or summed within one operand)")
            grad_terms = [out if j == k else t for j, t in enumerate(terms)]
            grad_inputs = [Operand(d_out, out) if j == k else op for j, op in enumerate(prim.inputs)]
            name = self._contribution_name(operand.tensor, prim.output.tensor)
            self._emit("einsum", grad_inputs, Operand(name, terms[k]), f"{','.join(grad_terms)}->{terms[k]}")
            self._contribute(operand.tensor, name)

    def _map(self, prim: Primitive, d_out: str) -> None:
        out_letters = prim.output.letters
        for operand in self._grad_operands(prim):
            positions = [k for k, op in enumerate(prim.inputs) if op == operand]
            deriv = ZERO
            for k in positions:
                deriv = add(deriv, prim.expression.derivative(k))
            if deriv == ZERO:
                continue
            if deriv == ONE and operand.letters == out_letters:
                self._contribute(operand.tensor, d_out)  # identity: alias the incoming gradient
                continue
            name = self._contribution_name(operand.tensor, prim.output.tensor)
            if deriv == ONE and set(operand.letters) == set(out_letters):  # a transposition
                self._emit("map", [Operand(d_out, out_letters)], Operand(name, operand.letters), "in0")
            elif deriv == ONE:
                self._emit("reduce", [Operand(d_out, out_letters)], Operand(name, operand.letters), "sum")
            else:
                used = deriv.inputs  # in0: the incoming gradient, then the operands the derivative reads
                expr = product(Input(0), deriv.substitute({old: Input(j + 1) for j, old in enumerate(used)})).source()
                inputs = [Operand(d_out, out_letters)] + [prim.inputs[old] for old in used]
                if set(operand.letters) == set(out_letters):
                    self._emit("map", inputs, Operand(name, operand.letters), expr)
                else:  # broadcast operand: gradient over the output's letters, then summed
                    full = self._new_tensor(f"{name}_unreduced", out_letters)
                    self._emit("map", inputs, Operand(full, out_letters), expr)
                    self._emit("reduce", [Operand(full, out_letters)], Operand(name, operand.letters), "sum")
            self._contribute(operand.tensor, name)

    def _reduce(self, prim: Primitive, d_out: str) -> None:
        (operand,) = prim.inputs
        name = self._contribution_name(operand.tensor, prim.output.tensor)
        d = Operand(d_out, prim.output.letters)
        if prim.expr == "sum":
            self._emit("map", [d], Operand(name, operand.letters), "in0")
        else:  # max: the gradient goes to the elements equal to the maximum
            self._emit("map", [d, operand, prim.output], Operand(name, operand.letters), "in0 * (in1 == in2)")
        self._contribute(operand.tensor, name)

    def _closed_form(self, core: ClosedForm, target: Primitive, d_out: str) -> None:
        prims = {p.name: p for p in self.graph.primitives}
        members = [prims[name] for name in core.members]
        x = next(op for p in members for op in p.inputs if op.tensor == core.input)
        y = target.output
        stats = "".join(letter for letter in y.letters if letter not in core.reduced)
        g = Operand(d_out, y.letters)
        name = self._contribution_name(core.input, core.output)
        if core.kind == "softmax":
            prod = self._new_tensor(f"{name}_dy_y", y.letters)
            total = self._new_tensor(f"{name}_sum", stats)
            self._emit("map", [g, y], Operand(prod, y.letters), "in0 * in1")
            self._emit("reduce", [Operand(prod, y.letters)], Operand(total, stats), "sum")
            self._emit("map", [y, g, Operand(total, stats)], Operand(name, x.letters), "in0 * (in1 - in2)")
        else:
            count = " * ".join(self.graph.letter_dims[letter] for letter in core.reduced)
            prod = self._new_tensor(f"{name}_g_xhat", y.letters)
            sum_g = self._new_tensor(f"{name}_sum_g", stats)
            sum_prod = self._new_tensor(f"{name}_sum_g_xhat", stats)
            self._emit("map", [g, y], Operand(prod, y.letters), "in0 * in1")
            self._emit("reduce", [g], Operand(sum_g, stats), "sum")
            self._emit("reduce", [Operand(prod, y.letters)], Operand(sum_prod, stats), "sum")
            scale = next(p.output for p in members if p.output.tensor == core.scale)
            apply = "*" if core.inverted else "/"
            self._emit("map", [g, Operand(sum_g, stats), y, Operand(sum_prod, stats), scale], Operand(name, x.letters),
                       f"(in0 - (in1 + in2 * in3) / ({count})) {apply} in4")
        self._contribute(core.input, name)

    def run(self) -> TrainingGraph:
        for out in self.graph.outputs:
            seed = self._new_tensor(f"d_{out}", self.graph.tensors[out].letters, "grad_output")
            self.seeds[out] = seed
            self._contribute(out, seed)
        derived: dict[str, tuple[int, int]] = {}
        for prim, core in reversed(self._emitting()):
            d_out = self._finalize(prim.output.tensor)
            if d_out is None:
                continue
            start = len(self.prims)
            if core is not None:
                self._closed_form(core, prim, d_out)
            elif prim.kind == "einsum":
                self._einsum(prim, d_out)
            elif prim.kind == "map":
                self._map(prim, d_out)
            else:
                self._reduce(prim, d_out)
            derived[prim.name] = (start, len(self.prims))
        inputs = [name for name, info in self.graph.tensors.items() if info.role == "input"]
        for name in inputs:
            self._finalize(name)
        grad_outputs = [self.grads[name] for name in inputs if name in self.grads]
        phases = {p.name: FORWARD for p in self.graph.primitives}
        phases.update({p.name: BACKWARD for p in self.prims})
        graph = PrimitiveGraph(self.tensors, list(self.graph.primitives) + self.prims, dict(self.graph.letter_dims),
                               dict(self.graph.dim_values), list(self.graph.outputs) + grad_outputs)
        return TrainingGraph(graph, phases, dict(self.grads), dict(self.seeds),
                             {name: tuple(p.name for p in self.prims[a:b]) for name, (a, b) in derived.items()},
                             list(self.closed_forms))


# --- ReLU's mask from its output ----------------------------------------------------------------

def relu_masks_from_outputs(training: TrainingGraph) -> TrainingGraph:
    """Make every ReLU's backward read the ReLU's output (or its dropout's) instead of its input.

    Match, structurally (no names): a forward map ``y = maximum(x, 0)`` element by element (x read
    under y's letters), whose only derived backward primitive is the map ``d_x = d_y * (x > 0)``.

    - Through a dropout: y's only reader is a forward map ``h = y * m`` (either order) with ``m`` of
      role "dropout" over the same letters, whose derived map ``d_y = d_h * m`` is y's whole
      gradient, read only by ``d_x``.  The two backward maps become one,
      ``d_x = d_h * (h > 0) * scale_m``, reading h instead of x and m.  Exact: m is 0 or
      s = ``dropout_scale(p)`` (>= 1), so h = y * m > 0 exactly where y > 0 (x > 0) and m = s, hence
      ``m * (x > 0) == (h > 0) * s`` element by element, and both sides round ``d_h * s`` once
      (``(d_h * (h > 0)) * s`` or ``(d_h * s) * 1``; y * s does not underflow to 0 as s >= 1).
      ``scale_m`` is the graph's scalar (``PrimitiveGraph.scalars``), so evaluation-mode graphs
      (p = 0, masks of ones) scale by 1 as their masks do.
    - Otherwise, when nothing else in the backward reads x: ``d_x = d_y * (y > 0)``.  Exact:
      maximum(x, 0) > 0 exactly where x > 0 (NaN compares false either way).

    Only ``maximum(x, 0)`` is rewritten, not ``maximum(0, x)``, whose derivative routes the
    gradient to x where x >= 0 (x == 0 included, where y > 0 is false).  The gain: the forward no
    longer saves x (BERT's pre-activation, as large as h, which the backward's weight gradient
    reads anyway) and the backward no longer regenerates the mask.
    """
    graph = training.graph
    prims = {p.name: p for p in graph.primitives}
    producer = graph.producer()
    consumers = graph.consumers()
    derived = {name: list(names) for name, names in training.derived.items()}
    replaced: dict[str, Primitive] = {}  # backward primitive -> its rewrite
    removed: set[str] = set()
    for relu in training.primitives(FORWARD):
        backward = [prims[name] for name in training.derived.get(relu.name, ())]
        if relu.kind != "map" or not relu.expression.matches("maximum(in0, 0)") or len(backward) != 1:
            continue
        (x,), y, (d_x,) = relu.inputs, relu.output, backward
        if x.letters != y.letters or d_x.kind != "map" or not d_x.expression.matches("in0 * (in1 > 0)") \
                or d_x.inputs[1] != x:
            continue
        d_y = d_x.inputs[0]
        through = _through_dropout(training, relu, d_y, consumers, producer)
        if through is not None:
            d_h, h, mask, via = through
            replaced[d_x.name] = Primitive(d_x.name, "map", (d_h, h), d_x.output, f"in0 * (in1 > 0) * {SCALE_PREFIX}{mask}")
            removed.add(via.name)
            derived = {name: [n for n in names if n != via.name] for name, names in derived.items()}
        elif all(reader.name == d_x.name or training.phases[reader.name] == FORWARD for reader in consumers[x.tensor]):
            replaced[d_x.name] = Primitive(d_x.name, "map", (d_y, y), d_x.output, d_x.expr)
    if not replaced:
        return training
    primitives = [replaced.get(p.name, p) for p in graph.primitives if p.name not in removed]
    gone = {prims[name].output.tensor for name in removed}
    tensors = {name: info for name, info in graph.tensors.items() if name not in gone}
    return TrainingGraph(PrimitiveGraph(tensors, primitives, graph.letter_dims, graph.dim_values, list(graph.outputs)),
                         {p.name: training.phases[p.name] for p in primitives},
                         {t: g for t, g in training.grads.items() if g not in gone}, dict(training.seeds),
                         {name: tuple(names) for name, names in derived.items()}, list(training.closed_forms))


def _through_dropout(training: TrainingGraph, relu: Primitive, d_y: Operand, consumers, producer
                     ) -> tuple[Operand, Operand, str, Primitive] | None:
    """For ReLU ``relu`` whose backward reads the gradient ``d_y`` of its output: (d_h, h, the
    mask, the backward map ``d_y = d_h * m``) with the operands named in ``relu``'s letters, when
    the output's one reader is a dropout ``h = y * m`` and ``d_y`` is all of y's gradient and read
    only by ReLU's backward; else None."""
    graph, y = training.graph, relu.output
    readers = consumers[y.tensor]
    if len(readers) != 1 or y.tensor in graph.outputs or d_y.tensor in graph.outputs:
        return None
    (drop,) = readers
    if drop.kind != "map" or len(drop.inputs) != 2 or not drop.expression.matches("in0 * in1", "in1 * in0"):
        return None
    mine = next((op for op in drop.inputs if op.tensor == y.tensor), None)
    mask = next((op for op in drop.inputs if op.tensor != y.tensor), None)
    if mine is None or mask is None or graph.tensors[mask.tensor].role != "dropout" \
            or not mine.letters == mask.letters == drop.output.letters:
        return None
    via = producer.get(d_y.tensor)
    if via is None or via.name not in training.derived.get(drop.name, ()) or via.kind != "map" \
            or not via.expression.matches("in0 * in1", "in1 * in0") or training.grads.get(y.tensor) != d_y.tensor \
            or len(consumers[d_y.tensor]) != 1:
        return None
    d_h = next((op for op in via.inputs if op.tensor != mask.tensor), None)
    if d_h is None or mask not in via.inputs or training.grads.get(drop.output.tensor) != d_h.tensor \
            or d_h.letters != drop.output.letters or via.output.letters != mine.letters:
        return None
    rename = dict(zip(mine.letters, y.letters))  # the dropout's letters -> the ReLU's
    to_relu = lambda op: Operand(op.tensor, "".join(rename[l] for l in op.letters))  # noqa: E731
    return to_relu(d_h), to_relu(drop.output), mask.tensor, via
