"""Reverse-mode derivation of the training graph from a forward ``PrimitiveGraph``.

Every forward primitive is differentiated from its kind and expression, never from a model's
names:

- einsum ``"A,B->C"``: the gradient of each operand is the einsum with that operand's term
  replaced by the output's (``"phi,ibj->phbj"`` gives dW ``"phbj,ibj->phi"`` and dX
  ``"phi,phbj->ibj"``);
- map: the chain rule on the expression's AST (symbolic derivative of +, -, *, /, **, exp, log,
  sqrt, tanh, abs, maximum/minimum (a mask, ReLU's ``in0 > 0``), where); an operand broadcast over
  letters of the output gets its gradient summed over them (bias gradients become reductions);
  a dropout is a multiplication by its mask tensor, so its backward multiplies by the same mask;
- reduce: sum broadcasts the gradient back, max routes it to the maxima;
- an element-wise operator of several maps (GELU written out) is inlined into one expression
  first, so its backward is one map reading the operator's inputs, not its inner tensors.

The derived graph is then rewritten so that ReLU's backward reads what the forward saves anyway
(``relu_masks_from_outputs``): ``d_x = d_y * (x > 0)`` for ``y = maximum(x, 0)`` becomes
``d_x = d_y * (y > 0)``, and through a dropout ``h = y * mask``, ``d_x = d_h * (h > 0) * scale``;
the forward then need not save x, and the backward need not regenerate the mask.

Normalizations are recognised structurally inside the forward normalization operators
(``dataflow.operators``): the maps between the reductions are composed into one symbolic
expression per tensor (sympy) and compared with the defining formula of

- softmax over R: ``y = exp(x - max_R x) / sum_R exp(x - max_R x)`` (max optional), whose backward
  is emitted in closed form ``dx = y * (dy - sum_R(dy * y))``;
- layernorm over R: ``xhat = (x - mean_R x) / sqrt(mean_R (x - mean)^2 + eps)`` (or times the
  inverse square root), backward ``dx = (g - (sum_R g + xhat * sum_R(g * xhat)) / |R|) / std``;
  the per-feature affine tail (gamma, beta) goes through the generic rules, which gives
  dgamma and dbeta as reductions.

A tensor read by several primitives (residual connections, Q/K/V sharing x) receives one
gradient contribution per reader; they are summed by one n-ary map ``in0 + in1 + ...``.
Gradient tensors are named ``d_<tensor>`` and stored in the order of ``<tensor>``'s letters;
single contributions that are identities (a residual's ``+``) alias the incoming gradient
instead of copying it.
"""
from __future__ import annotations

import ast
from dataclasses import dataclass

import sympy

from datamove.dataflow.graph import SCALE_PREFIX, Operand, Primitive, PrimitiveGraph, TensorInfo, is_expression
from datamove.dataflow.operators import NORMALIZATION, Operator, group_operators, make_operator

FORWARD, BACKWARD = "forward", "backward"


@dataclass(frozen=True)
class ClosedForm:
    """A normalization recognised in the forward graph, differentiated in closed form.

    ``kind``: "softmax" or "layernorm"; ``members``: the forward primitives from ``input`` to
    ``output`` that the closed form replaces; ``reduced``: the normalised letters R (in the
    members' naming); ``scale``: layernorm's tensor over the letters outside R holding
    sqrt(var + eps) (``inverted``: it holds 1 / sqrt(var + eps) instead).
    """

    kind: str
    members: tuple[str, ...]
    input: str
    output: str
    reduced: str
    scale: str | None = None
    inverted: bool = False


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


# --- symbolic derivatives of map expressions ----------------------------------------------------

def _const(node: ast.expr, value: float) -> bool:
    return isinstance(node, ast.Constant) and not isinstance(node.value, bool) and node.value == value


def _num(value: float) -> ast.expr:
    return ast.Constant(value)


def _add(a: ast.expr, b: ast.expr) -> ast.expr:
    if _const(a, 0):
        return b
    if _const(b, 0):
        return a
    return ast.BinOp(a, ast.Add(), b)


def _neg(a: ast.expr) -> ast.expr:
    if _const(a, 0):
        return a
    if isinstance(a, ast.UnaryOp) and isinstance(a.op, ast.USub):
        return a.operand
    return ast.UnaryOp(ast.USub(), a)


def _sub(a: ast.expr, b: ast.expr) -> ast.expr:
    if _const(b, 0):
        return a
    if _const(a, 0):
        return _neg(b)
    return ast.BinOp(a, ast.Sub(), b)


def _mul(a: ast.expr, b: ast.expr) -> ast.expr:
    if _const(a, 0) or _const(b, 0):
        return _num(0)
    if _const(a, 1):
        return b
    if _const(b, 1):
        return a
    if _const(b, -1):
        return _neg(a)
    if isinstance(b, ast.BinOp) and isinstance(b.op, ast.Div) and _const(b.left, 1):
        return ast.BinOp(a, ast.Div(), b.right)
    return ast.BinOp(a, ast.Mult(), b)


def _div(a: ast.expr, b: ast.expr) -> ast.expr:
    if _const(a, 0):
        return a
    if _const(b, 1):
        return a
    return ast.BinOp(a, ast.Div(), b)


def _call(name: str, *args: ast.expr) -> ast.expr:
    return ast.Call(ast.Name(name, ast.Load()), list(args), [])


def _compare(a: ast.expr, op: ast.cmpop, b: ast.expr) -> ast.expr:
    return ast.Compare(a, [op], [b])


def derivative(node: ast.expr, var: str) -> ast.expr:
    """d(node)/d(var) as a simplified AST; ``var`` is an operand name such as ``"in0"``.

    maximum(a, b) sends the gradient to a where a > b and to b elsewhere (so ReLU, maximum(x, 0),
    gives ``x > 0``, as torch.relu); minimum(a, b) to a where a < b.
    """
    d = lambda n: derivative(n, var)  # noqa: E731
    if isinstance(node, ast.Name):
        return _num(1) if node.id == var else _num(0)
    if isinstance(node, (ast.Constant, ast.Compare)):
        return _num(0)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        inner = d(node.operand)
        return _neg(inner) if isinstance(node.op, ast.USub) else inner
    if isinstance(node, ast.BinOp):
        a, b = node.left, node.right
        if isinstance(node.op, ast.Add):
            return _add(d(a), d(b))
        if isinstance(node.op, ast.Sub):
            return _sub(d(a), d(b))
        if isinstance(node.op, ast.Mult):
            return _add(_mul(d(a), b), _mul(a, d(b)))
        if isinstance(node.op, ast.Div):
            return _sub(_div(d(a), b), _div(_mul(a, d(b)), ast.BinOp(b, ast.Mult(), b)))
        if isinstance(node.op, ast.Pow):
            da, db = d(a), d(b)
            power = _mul(_mul(b, ast.BinOp(a, ast.Pow(), _sub(b, _num(1)))), da)
            if _const(db, 0):
                return power
            return _add(power, _mul(_mul(node, _call("log", a)), db))
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
        name, args = node.func.id, node.args
        if name == "exp":
            return _mul(node, d(args[0]))
        if name == "log":
            return _div(d(args[0]), args[0])
        if name == "sqrt":
            return _div(d(args[0]), _mul(_num(2), node))
        if name == "tanh":
            return _mul(_sub(_num(1), ast.BinOp(node, ast.Pow(), _num(2))), d(args[0]))
        if name == "abs":
            return _mul(_call("sign", args[0]), d(args[0]))
        if name in ("maximum", "minimum"):
            a, b = args
            first = _compare(a, ast.Gt() if name == "maximum" else ast.Lt(), b)
            second = _compare(a, ast.LtE() if name == "maximum" else ast.GtE(), b)
            return _add(_mul(d(a), first), _mul(d(b), second))
        if name == "where":
            cond, a, b = args
            da, db = d(a), d(b)
            if _const(da, 0) and _const(db, 0):
                return _num(0)
            return _call("where", cond, da, db)
    raise ValueError(f"cannot differentiate {ast.unparse(node)!r}: unsupported construct")


class _Rename(ast.NodeTransformer):
    def __init__(self, names: dict[str, str]):
        self.names = names

    def visit_Name(self, node: ast.Name):
        return ast.Name(self.names.get(node.id, node.id), ast.Load())


def _operand_names(node: ast.expr) -> list[str]:
    names = {n.id for n in ast.walk(node) if isinstance(n, ast.Name) and n.id.startswith("in") and n.id[2:].isdigit()}
    return sorted(names, key=lambda n: int(n[2:]))


# --- recognising normalizations -----------------------------------------------------------------

_SYMPY_FUNCTIONS = {"exp": sympy.exp, "log": sympy.log, "sqrt": sympy.sqrt, "tanh": sympy.tanh,
                    "maximum": sympy.Max, "minimum": sympy.Min, "abs": sympy.Abs}


@dataclass
class _Composed:
    """Symbolic values of an operator's tensors: leaves are outside tensors and reductions."""

    values: dict[str, sympy.Expr]
    reductions: dict[str, tuple[str, sympy.Expr, Primitive]]  # output -> (sum|max, body, primitive)
    leaves: dict[sympy.Symbol, str]


def _compose(graph: PrimitiveGraph, prims: list[Primitive]) -> _Composed | None:
    """Inline the maps of ``prims`` into one expression per tensor; None if letters are not used
    consistently (a tensor read under other letters than it has)."""
    letters = {p.output.tensor: p.output.letters for p in prims}
    values: dict[str, sympy.Expr] = {}
    reductions, leaves = {}, {}

    def value(operand: Operand):
        name = operand.tensor
        if letters.setdefault(name, operand.letters) != operand.letters:
            return None
        if name not in values:
            symbol = sympy.Symbol(f"t_{name}")
            values[name], leaves[symbol] = symbol, name
        return values[name]

    dims = {dim: sympy.Symbol(dim, positive=True) for dim in set(graph.letter_dims.values())}
    for prim in prims:
        operands = [value(op) for op in prim.inputs]
        if any(v is None for v in operands):
            return None
        if prim.kind == "reduce":
            symbol = sympy.Symbol(f"r_{prim.output.tensor}")
            reductions[prim.output.tensor] = (prim.expr, operands[0], prim)
            values[prim.output.tensor] = symbol
        elif prim.kind == "map":
            names = {f"in{k}": v for k, v in enumerate(operands)}
            values[prim.output.tensor] = sympy.sympify(prim.expr, locals={**_SYMPY_FUNCTIONS, **dims, **names})
        else:
            return None
    return _Composed(values, reductions, leaves)


def _same(a: sympy.Expr, b: sympy.Expr) -> bool:
    return a == b or sympy.simplify(a - b) == 0


def _closed_form_members(prims: list[Primitive], output: str) -> list[Primitive]:
    """The primitives of ``prims`` that ``output`` depends on."""
    producer = {p.output.tensor: p for p in prims}
    needed, stack = set(), [output]
    while stack:
        tensor = stack.pop()
        prim = producer.get(tensor)
        if prim is not None and prim.name not in needed:
            needed.add(prim.name)
            stack.extend(op.tensor for op in prim.inputs)
    return [p for p in prims if p.name in needed]


def _match(graph: PrimitiveGraph, prims: list[Primitive], x_name: str) -> ClosedForm | None:
    """A softmax or layernorm of tensor ``x_name`` computed by ``prims`` (which do not make it)."""
    composed = _compose(graph, prims)
    if composed is None:
        return None
    x = next((symbol for symbol, name in composed.leaves.items() if name == x_name), None)
    if x is None:
        return None
    dims = {dim: sympy.Symbol(dim, positive=True) for dim in set(graph.letter_dims.values())}
    sums = [(name, body, prim) for name, (kind, body, prim) in composed.reductions.items() if kind == "sum"]
    maxes = [(name, prim) for name, (kind, body, prim) in composed.reductions.items() if kind == "max" and body == x]
    candidates = [p for p in prims if p.kind == "map"]

    def found(kind: str, target: Primitive, reduced: str, **extra) -> ClosedForm | None:
        members = _closed_form_members(prims, target.output.tensor)
        inside = {p.name for p in members}
        consumers = graph.consumers()
        for prim in members:  # the core's intermediates must not be read outside it
            if prim is not target and any(c.name not in inside for c in consumers[prim.output.tensor]):
                return None
        return ClosedForm(kind, tuple(p.name for p in members), x_name, target.output.tensor, reduced, **extra)

    for z_name, z_body, z_prim in sums:  # softmax: exp(x - max x) / sum exp(x - max x), max optional
        reduced = z_prim.reduced
        for m_name in [None] + [m for m, m_prim in maxes if m_prim.reduced == reduced]:
            shifted = sympy.exp(x - composed.values[m_name]) if m_name else sympy.exp(x)
            if not _same(z_body, shifted):
                continue
            for target in candidates:
                if set(target.output.letters) == set(z_prim.inputs[0].letters) and \
                        _same(composed.values[target.output.tensor], shifted / composed.values[z_name]):
                    return found("softmax", target, reduced)
    for a_name, a_body, a_prim in sums:  # layernorm: (x - mean x) / sqrt(mean (x - mean x)^2 + eps)
        if a_body != x:
            continue
        reduced = a_prim.reduced
        count = sympy.Mul(*[dims[graph.letter_dims[letter]] for letter in reduced])
        centred = x - composed.values[a_name] / count
        for b_name, b_body, b_prim in sums:
            if b_prim.reduced != reduced or not _same(b_body, centred ** 2):
                continue
            variance = composed.values[b_name] / count
            for target in candidates:
                value = composed.values[target.output.tensor]
                if set(target.output.letters) != set(a_prim.inputs[0].letters) or not value.has(x):
                    continue
                eps = sympy.simplify((centred / value) ** 2 - variance)
                if not (eps.is_number and eps >= 0):
                    continue
                std = sympy.sqrt(variance + eps)
                for scale in candidates:
                    if set(scale.output.letters) != set(a_prim.output.letters):
                        continue
                    s = composed.values[scale.output.tensor]
                    if _same(s, std) or _same(s * std, 1):
                        return found("layernorm", target, reduced, scale=scale.output.tensor,
                                     inverted=not _same(s, std))
    return None


def recognise_normalizations(graph: PrimitiveGraph) -> list[ClosedForm]:
    """Softmax and layernorm cores in the forward normalization operators of ``graph``.

    Every tensor read inside an operator is tried as the core's input x (an operator may chain
    several normalizations over the same letters); cores do not overlap."""
    result = []
    for op in group_operators(graph, FORWARD):
        if op.cls != NORMALIZATION:
            continue
        prims, taken = list(op.primitives), set()
        for x_name in dict.fromkeys(o.tensor for p in prims for o in p.inputs):
            upstream = {p.name for p in _closed_form_members(prims, x_name)}
            match = _match(graph, [p for p in prims if p.name not in upstream], x_name)
            if match is not None and not taken & set(match.members):
                result.append(match)
                taken |= set(match.members)
    return result


def _composed_map(prims: list[Primitive]) -> Primitive | None:
    """Maps ``prims`` (in order) inlined into one map named after the last; None when an inner
    tensor is read under other letters than it was written with."""
    exprs: dict[str, tuple[ast.expr, str]] = {}
    operands: list[Operand] = []
    for prim in prims:
        names = {}
        for k, op in enumerate(prim.inputs):
            if op.tensor in exprs:
                expr, letters = exprs[op.tensor]
                if letters != op.letters:
                    return None
                names[f"in{k}"] = expr
            else:
                if op not in operands:
                    operands.append(op)
                names[f"in{k}"] = ast.Name(f"in{operands.index(op)}", ast.Load())
        exprs[prim.output.tensor] = (_Inline(names).visit(ast.parse(prim.expr, mode="eval").body), prim.output.letters)
    last = prims[-1]
    return Primitive(last.name, "map", tuple(operands), last.output, ast.unparse(exprs[last.output.tensor][0]))


class _Inline(ast.NodeTransformer):
    def __init__(self, names: dict[str, ast.expr]):
        self.names = names

    def visit_Name(self, node: ast.Name):
        return self.names.get(node.id, node)


def elementwise_chains(graph: PrimitiveGraph) -> list[tuple[tuple[str, ...], Primitive]]:
    """Forward element-wise operators of several maps (e.g. GELU written out) whose inner tensors
    nobody else reads: (member names, the maps inlined into one).  Differentiating the inlined map
    gives one backward map reading only the operator's inputs, not its inner tensors."""
    consumers = graph.consumers()
    result = []
    for op in group_operators(graph, FORWARD):
        prims = list(op.primitives)
        if op.cls == NORMALIZATION or len(prims) < 2 or any(p.kind != "map" for p in prims):
            continue
        inside = {p.name for p in prims}
        if any(c.name not in inside for p in prims[:-1] for c in consumers[p.output.tensor]) \
                or any(p.output.tensor in graph.outputs for p in prims[:-1]):
            continue
        composed = _composed_map(prims)
        if composed is not None:
            result.append((tuple(p.name for p in prims), composed))
    return result


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
        if len(parts) == 1:
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
        body = ast.parse(prim.expr, mode="eval").body
        out_letters = prim.output.letters
        for operand in self._grad_operands(prim):
            positions = [k for k, op in enumerate(prim.inputs) if op == operand]
            deriv = _num(0)
            for k in positions:
                deriv = _add(deriv, derivative(body, f"in{k}"))
            if _const(deriv, 0):
                continue
            if _const(deriv, 1) and operand.letters == out_letters:
                self._contribute(operand.tensor, d_out)  # identity: alias the incoming gradient
                continue
            name = self._contribution_name(operand.tensor, prim.output.tensor)
            if _const(deriv, 1) and set(operand.letters) == set(out_letters):  # a transposition
                self._emit("map", [Operand(d_out, out_letters)], Operand(name, operand.letters), "in0")
            elif _const(deriv, 1):
                self._emit("reduce", [Operand(d_out, out_letters)], Operand(name, operand.letters), "sum")
            else:
                used = _operand_names(deriv)
                rename = {"__d": "in0", **{old: f"in{j + 1}" for j, old in enumerate(used)}}
                expr = ast.unparse(_Rename(rename).visit(_mul(ast.Name("__d", ast.Load()), deriv)))
                inputs = [Operand(d_out, out_letters)] + [prim.inputs[int(old[2:])] for old in used]
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
        if relu.kind != "map" or not is_expression(relu.expr, "maximum(in0, 0)") or len(backward) != 1:
            continue
        (x,), y, (d_x,) = relu.inputs, relu.output, backward
        if x.letters != y.letters or not is_expression(d_x.expr, "in0 * (in1 > 0)") or d_x.inputs[1] != x:
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
    if drop.kind != "map" or len(drop.inputs) != 2 or not is_expression(drop.expr, "in0 * in1", "in1 * in0"):
        return None
    mine = next((op for op in drop.inputs if op.tensor == y.tensor), None)
    mask = next((op for op in drop.inputs if op.tensor != y.tensor), None)
    if mine is None or mask is None or graph.tensors[mask.tensor].role != "dropout" \
            or not mine.letters == mask.letters == drop.output.letters:
        return None
    via = producer.get(d_y.tensor)
    if via is None or via.name not in training.derived.get(drop.name, ()) or via.kind != "map" \
            or not is_expression(via.expr, "in0 * in1", "in1 * in0") or training.grads.get(y.tensor) != d_y.tensor \
            or len(consumers[d_y.tensor]) != 1:
        return None
    d_h = next((op for op in via.inputs if op.tensor != mask.tensor), None)
    if d_h is None or mask not in via.inputs or training.grads.get(drop.output.tensor) != d_h.tensor \
            or d_h.letters != drop.output.letters or via.output.letters != mine.letters:
        return None
    rename = dict(zip(mine.letters, y.letters))  # the dropout's letters -> the ReLU's
    to_relu = lambda op: Operand(op.tensor, "".join(rename[l] for l in op.letters))  # noqa: E731
    return to_relu(d_h), to_relu(drop.output), mask.tensor, via
