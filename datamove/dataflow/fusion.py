"""Fusion of the training graph (Ivanov et al., Sec. IV), rule by rule, to a fixed point.

Fusion groups primitives into operators (one kernel each); only algebraic fusion rewrites
primitives (it splits an accumulation sum), so every fused graph still runs on the reference
executor.  Each rule is a class holding its pattern, legality check and rewrite; ``fuse`` applies
the first rule (in ``RULES`` order) that has a legal match, then starts over, until none has.

Rules, none of which knows a model's names:

- ``StackContractions`` (algebraic fusion, Sec. IV-D): contractions of one phase that share an
  input and have the same letter pattern up to renaming (Q/K/V projections, their dW), or whose
  outputs are summed into one gradient (Q/K/V dX), become one contraction over an extra stack
  letter;
- ``FuseNonContractions`` (Sec. IV): two adjacent (producer/consumer or co-reading) element-wise
  or normalization operators fuse when their iteration spaces are compatible -- the same letters
  once aligned through the shared tensor, and at most one reduction (set of reduced letters)
  between them -- and fusing creates no cycle; a shuffle (``dataflow.shuffle``: rotate_half's
  einsum with a constant signed permutation) is element-wise over its output's letters, reading its
  array there, and fuses only where what it reads is loaded or computed by maps (which the kernel
  recomputes at the moved index).  Fuse maximally: taken whenever it does not
  increase the minimal data movement, the largest saving first, ties in program order;
- ``StackElementwise``: structurally identical operators on the members of a stacked contraction
  (Q/K/V biases, their gradients) run as one operator over the stack letter;
- ``JoinReductionAcrossContraction``: a reduction whose results nobody reads (a bias gradient)
  joins the next operator past a contraction reading the same tensor when that operator reduces
  over the same letters (one launch instead of two);
- ``ScaleIntoContraction`` (Sec. IV-C): a lone map scaling by a constant fuses into the
  contraction it reads from or feeds -- the only thing that fuses into a contraction, and only
  when no non-contraction neighbour took it.

The fused attention (einsum -> (scale) -> softmax -> (dropout) -> einsum as one flash-attention-style
operator) is no rule: ``dataflow.attention`` recognises it on the fused graph, beside the plan.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from datamove.dataflow.autodiff import TrainingGraph
from datamove.dataflow.graph import Operand, Primitive, PrimitiveGraph, TensorInfo
from datamove.dataflow.operators import CONTRACTION, NORMALIZATION, Operator, classify, make_operator
from datamove.dataflow.shuffle import element_inputs, shuffle_of
from datamove.dataflow.union_find import UnionFind


@dataclass(frozen=True)
class Stack:
    """How a stacked operator runs its members as one: over ``letter`` of extent ``size``.

    ``members``: the primitives of each member, in stack order (for a contraction, its einsum);
    ``tensors``: the stacked tensors, one tuple per stacked operand (member order);
    ``expr``: for a contraction, the stacked einsum (e.g. ``"zphi,ibj->zphbj"``).
    """

    letter: str
    size: int
    members: tuple[tuple[str, ...], ...]
    tensors: tuple[tuple[str, ...], ...]
    expr: str = ""


@dataclass
class _Group:
    prims: list[str]
    phase: str
    merged: list[str]
    rules: list[str] = field(default_factory=list)
    stack: Stack | None = None


@dataclass
class FusedGraph:
    """A fused training graph: ``operators`` (in a valid execution order) over ``graph``'s
    primitives (``phases``: each one's phase); ``merged`` / ``rules`` / ``stacks`` say per fused
    operator which unfused operators it merges, which rules built it and how a stacked one runs."""

    training: TrainingGraph
    graph: PrimitiveGraph
    phases: dict[str, str]
    unfused: list[Operator]
    operators: list[Operator]
    merged: dict[str, tuple[str, ...]]
    rules: dict[str, tuple[str, ...]]
    stacks: dict[str, Stack]


class FusionState:
    """Operators as groups of primitive names over a (rewritable) training graph."""

    def __init__(self, training: TrainingGraph):
        self.graph = PrimitiveGraph(dict(training.graph.tensors), list(training.graph.primitives),
                                    training.graph.letter_dims, training.graph.dim_values, list(training.graph.outputs))
        self.phases = dict(training.phases)
        self.unfused = training.operators()
        self.groups: dict[int, _Group] = {}
        for n, op in enumerate(self.unfused):
            self.groups[n] = _Group([p.name for p in op.primitives], op.phase, [op.name])
        self._next = len(self.unfused)
        self._index()

    # indexes over the current graph and groups
    def _index(self) -> None:
        self.prim = {p.name: p for p in self.graph.primitives}
        self.position = {p.name: n for n, p in enumerate(self.graph.primitives)}
        self.producer = {p.output.tensor: p.name for p in self.graph.primitives}
        self.shuffles = {p.name: s for p in self.graph.primitives if (s := shuffle_of(self.graph, p)) is not None}
        # what each primitive reads, element-wise: a shuffle its array under its output's letters, not its constant
        self.reads = {p.name: element_inputs(self.graph, p) for p in self.graph.primitives}
        self.readers: dict[str, list[str]] = {}
        for p in self.graph.primitives:
            for op in self.reads[p.name]:
                users = self.readers.setdefault(op.tensor, [])
                if p.name not in users:
                    users.append(p.name)
        self.owner = {name: gid for gid, group in self.groups.items() for name in group.prims}
        self._descendants: dict[int, set[int]] | None = None

    def size(self, tensor: str) -> int:
        return self.graph.size(self.graph.tensors[tensor].letters)

    def cls(self, gid: int) -> str:
        return classify(self.graph, [self.prim[name] for name in self.groups[gid].prims])

    def letters(self, name: str) -> str:
        """A primitive's iteration letters (a shuffle's: its output's)."""
        return self.prim[name].output.letters if name in self.shuffles else self.prim[name].letters

    def gathers_computable(self, gids) -> bool:
        """Whether every shuffle of groups ``gids`` run as one reads a loaded tensor or one that maps
        compute from loaded tensors (what the kernel recomputes at the moved index), no dropout mask
        (drawn at its own index)."""
        names = {n for gid in gids for n in self.groups[gid].prims}
        for name in names & set(self.shuffles):
            stack = [self.reads[name][0].tensor]
            while stack:
                tensor = stack.pop()
                if self.graph.tensors[tensor].role == "dropout":
                    return False
                source = self.producer.get(tensor)
                if source is None or source not in names:
                    continue
                if self.prim[source].kind != "map":
                    return False
                stack.extend(op.tensor for op in self.prim[source].inputs)
        return True

    def io(self, names) -> int:
        """Minimal I/O of primitives ``names`` run as one operator: distinct elements of the
        tensors they read from outside plus those they write that are read outside or are outputs."""
        names = set(names)
        produced = {self.prim[n].output.tensor for n in names}
        inputs = {op.tensor for n in names for op in self.reads[n]} - produced
        outputs = {t for t in produced
                   if t in self.graph.outputs or any(r not in names for r in self.readers.get(t, []))}
        return sum(self.size(t) for t in inputs | outputs)

    def group_io(self, *gids: int) -> int:
        return self.io(name for gid in gids for name in self.groups[gid].prims)

    def tensors_of(self, gid: int) -> tuple[set[str], set[str]]:
        """(tensors read, tensors written) by group ``gid``."""
        names = self.groups[gid].prims
        return {op.tensor for n in names for op in self.reads[n]}, {self.prim[n].output.tensor for n in names}

    def successors(self, gid: int) -> set[int]:
        result = set()
        for name in self.groups[gid].prims:
            for reader in self.readers.get(self.prim[name].output.tensor, []):
                if self.owner[reader] != gid:
                    result.add(self.owner[reader])
        return result

    def descendants(self, gid: int) -> set[int]:
        if self._descendants is None:
            self._descendants = {}
            for g in reversed(self.topological()):
                found = set()
                for s in self.successors(g):
                    found.add(s)
                    found |= self._descendants[s]
                self._descendants[g] = found
        return self._descendants[gid]

    def creates_cycle(self, gids: list[int]) -> bool:
        """Whether merging ``gids`` closes a cycle: a path between two of them through another group."""
        members = set(gids)
        for g in gids:
            for s in self.successors(g) - members:
                if members & ({s} | self.descendants(s)):
                    return True
        return False

    def topological(self) -> list[int]:
        """Groups in dependency order, ties by their first primitive's position."""
        first = {gid: self.first(gid) for gid in self.groups}
        indegree = {gid: 0 for gid in self.groups}
        succ = {gid: self.successors(gid) for gid in self.groups}
        for gid in self.groups:
            for s in succ[gid]:
                indegree[s] += 1
        ready = sorted((g for g, d in indegree.items() if d == 0), key=first.get)
        order = []
        while ready:
            gid = ready.pop(0)
            order.append(gid)
            for s in succ[gid]:
                indegree[s] -= 1
                if indegree[s] == 0:
                    ready.append(s)
            ready.sort(key=first.get)
        if len(order) != len(self.groups):
            raise RuntimeError("fusion produced a cyclic operator graph")
        return order

    def first(self, gid: int) -> int:
        return min(self.position[n] for n in self.groups[gid].prims)

    def merge(self, gids: list[int], rule: str, stack: Stack | None = None) -> int:
        """Replace groups ``gids`` by one; returns its id."""
        groups = [self.groups.pop(g) for g in gids]
        names = sorted((n for g in groups for n in g.prims), key=self.position.get)
        merged = [m for g in groups for m in g.merged]
        rules = list(dict.fromkeys([r for g in groups for r in g.rules] + [rule]))
        gid = self._next
        self._next += 1
        self.groups[gid] = _Group(names, groups[0].phase, merged, rules, stack)
        self._index()
        return gid

    def replace(self, old: str, new: list[Primitive], tensors: list[TensorInfo], owners: list[int]) -> None:
        """Replace primitive ``old`` by ``new`` (in order, where ``old`` stood), owned by ``owners``."""
        at = self.position[old]
        phase = self.phases.pop(old)
        for gid, group in self.groups.items():
            if old in group.prims:
                group.prims.remove(old)
        for info in tensors:
            self.graph.tensors[info.name] = info
        self.graph.primitives[at:at + 1] = new
        for prim, gid in zip(new, owners):
            self.phases[prim.name] = phase
            self.groups[gid].prims.append(prim.name)
        self.groups = {gid: g for gid, g in self.groups.items() if g.prims}
        self._index()
        for group in self.groups.values():
            group.prims.sort(key=self.position.get)

    def unused_letter(self) -> str:
        taken = set(self.graph.letter_dims)
        return next(letter for letter in "zyxwvutsrqponmlkjihgfedcba" if letter not in taken)


# --- letters: alignment and canonical patterns --------------------------------------------------

def _canonical(terms: list[str], letter_dims: dict[str, str]) -> tuple[str, tuple[str, ...]]:
    """Terms with letters renamed by first appearance, and the dims of the renamed letters."""
    rename: dict[str, str] = {}
    for letter in "".join(terms):
        rename.setdefault(letter, chr(ord("a") + len(rename)))
    return ",".join("".join(rename[l] for l in t) for t in terms), tuple(letter_dims[l] for l in rename)


def _naming(state: FusionState, gid: int) -> dict[tuple[str, str], str]:
    """{(primitive, its letter): the group's letter}: a primitive's letters unified with the others'
    through the axes of the tensors they share, each class named by its first letter in primitive
    order.  (Primitives of a group mostly name a dim alike; a shuffle's output letter differs from
    the one its array is read under, rotate_half's gradient writing over ``a`` what it reads over ``e``.)"""
    names = state.groups[gid].prims
    classes = UnionFind()
    for name in names:
        for op in (*state.reads[name], state.prim[name].output):
            for axis, letter in enumerate(op.letters):
                classes.union(("t", op.tensor, axis), ("p", name, letter))
    first: dict = {}
    result = {}
    for name in names:
        for letter in state.letters(name):
            result[(name, letter)] = first.setdefault(classes.find(("p", name, letter)), letter)
    return result


def _access(state: FusionState, gid: int, tensor: str) -> str | None:
    """The letters (the group's, ``_naming``) under which group ``gid`` writes or reads ``tensor``."""
    naming = _naming(state, gid)
    for name in state.groups[gid].prims:
        prim = state.prim[name]
        for op in (prim.output, *state.reads[name]):
            if op.tensor == tensor:
                return "".join(naming[(name, l)] for l in op.letters)
    return None


def _space(state: FusionState, gid: int) -> tuple[set[str], set[frozenset]]:
    """Iteration-space letters of a group (``_naming``'s) and its distinct reduction letter sets."""
    naming = _naming(state, gid)
    names = state.groups[gid].prims
    return set(naming.values()), {frozenset(naming[(n, l)] for l in state.prim[n].reduced)
                                  for n in names if state.prim[n].kind == "reduce"}


def _compatible(state: FusionState, a: int, b: int, tensor: str) -> bool:
    """Same iteration space once ``a``'s letters are renamed to ``b``'s through ``tensor``, and
    at most one reduction between them (the paper: same, or one only adds a reduction)."""
    la, lb = _access(state, a, tensor), _access(state, b, tensor)
    if la is None or lb is None or len(la) != len(lb):
        return False
    rename = dict(zip(la, lb))
    space_a, red_a = _space(state, a)
    space_b, red_b = _space(state, b)
    mapped = {rename.get(l, l) for l in space_a}
    if len(mapped) != len(space_a) or mapped != space_b:
        return False
    if any(state.graph.letter_dims[l] != state.graph.letter_dims[rename.get(l, l)] for l in space_a):
        return False
    reductions = {frozenset(rename.get(l, l) for l in r) for r in red_a} | red_b
    return len(reductions) <= 1


def _group_signature(state: FusionState, gid: int) -> tuple:
    """The structure of a group up to renaming of letters and tensors: per primitive, its kind,
    expression and canonical operand letters, and whether each operand is made inside."""
    prims = [state.prim[n] for n in state.groups[gid].prims]
    produced = {p.output.tensor for p in prims}
    local: dict[str, int] = {}
    terms, shape = [], []
    for p in prims:
        operands = list(p.inputs) + [p.output]
        terms += [op.letters for op in operands]
        shape.append((p.kind, p.expr, tuple(
            ("in", local.setdefault(op.tensor, len(local))) if op.tensor in produced
            else ("out", state.graph.tensors[op.tensor].role) for op in operands)))
    return tuple(shape), _canonical(terms, state.graph.letter_dims)


# --- rules --------------------------------------------------------------------------------------

class Rule:
    """A fusion rule: ``candidates`` (pattern, best first), ``legal``, ``rewrite``."""

    name = "rule"

    def candidates(self, state: FusionState) -> list:
        raise NotImplementedError

    def legal(self, state: FusionState, match) -> bool:
        raise NotImplementedError

    def rewrite(self, state: FusionState, match) -> None:
        raise NotImplementedError

    def apply(self, state: FusionState) -> bool:
        for match in self.candidates(state):
            if self.legal(state, match):
                self.rewrite(state, match)
                return True
        return False


def _single_einsum(state: FusionState, gid: int) -> Primitive | None:
    group = state.groups[gid]
    if len(group.prims) == 1 and group.stack is None and state.prim[group.prims[0]].kind == "einsum" \
            and group.prims[0] not in state.shuffles:
        return state.prim[group.prims[0]]
    return None


def _is_accumulation(prim: Primitive) -> bool:
    """An n-ary gradient sum ``in0 + in1 + ...`` over operands with the output's letters."""
    return (prim.kind == "map" and len(prim.inputs) >= 2 and prim.expression.is_sum_of_inputs(len(prim.inputs))
            and all(op.letters == prim.output.letters for op in prim.inputs))


class StackContractions(Rule):
    """Pattern: single-einsum contractions of one phase that (a) share an input tensor, read the
    same way, or (b) whose outputs are only summed by one accumulation map; with the same letter
    pattern up to renaming (same dims).  Legal: mutually independent (no path between them), and
    none of the tensors it would stack stacked in another group with other members (a stacked
    tensor has one buffer).  Rewrite: one stacked contraction; for (b) the accumulation is split so that the sum of the
    stacked outputs (a sum over the stack letter) belongs to the stacked contraction."""

    name = "stack-contractions"

    def candidates(self, state):
        found = []
        einsums = {gid: e for gid in state.groups if (e := _single_einsum(state, gid)) is not None}
        by_input: dict[str, list[tuple[int, int]]] = {}
        for gid, e in einsums.items():
            for k, op in enumerate(e.inputs):
                by_input.setdefault(op.tensor, []).append((gid, k))
        for tensor, uses in by_input.items():
            classes: dict[tuple, list[tuple[int, int]]] = {}
            for gid, k in uses:
                e = einsums[gid]
                terms, out = e.expr.split("->")[0].split(","), e.expr.split("->")[1]
                order = [terms[k]] + [t for j, t in enumerate(terms) if j != k] + [out]
                key = (state.groups[gid].phase, k, _canonical(order, state.graph.letter_dims))
                classes.setdefault(key, []).append((gid, k))
            found += [("input", members) for members in classes.values() if len(members) > 1]
        for prim in state.graph.primitives:
            if not _is_accumulation(prim):
                continue
            classes = {}
            for op in prim.inputs:
                gid = state.owner.get(state.producer.get(op.tensor, ""), None)
                if gid not in einsums or state.readers[op.tensor] != [prim.name]:
                    continue
                e = einsums[gid]
                terms, out = e.expr.split("->")[0].split(","), e.expr.split("->")[1]
                key = (state.groups[gid].phase, _canonical([out] + terms, state.graph.letter_dims))
                classes.setdefault(key, []).append((gid, prim.name))
            found += [("sum", members) for members in classes.values() if len(members) > 1]
        return found

    def legal(self, state, match):
        kind, members = match
        gids = [gid for gid, _ in members]
        if len(set(gids)) != len(gids):
            return False
        if not all(not (state.descendants(a) & set(gids)) for a in gids):
            return False
        # a tensor is stacked in one group only (its members share one buffer): a stack that would
        # hold v with k where another holds v with k_x (GQA's repeated K and V after their projections)
        # is left apart
        einsums = [_single_einsum(state, gid) for gid in gids]
        terms = len(einsums[0].inputs)
        shared = {members[0][1]} if kind == "input" else set()
        operands = [[e.inputs[j].tensor for e in einsums] for j in range(terms) if j not in shared]
        if any(len(set(tensors)) < len(tensors) for tensors in operands):
            return False  # one tensor twice in a stacked operand (x @ w1 written twice): no buffer holds it so
        stacked = [set(tensors) for tensors in operands]
        stacked.append({e.output.tensor for e in einsums})
        held = [set(t) for g in state.groups.values() if g.stack is not None for t in g.stack.tensors if len(t) > 1]
        return not any(s & h and s != h for s in stacked if len(s) > 1 for h in held)

    def rewrite(self, state, match):
        kind, members = match
        members = sorted(members, key=lambda m: state.first(m[0]))
        gids = [gid for gid, _ in members]
        einsums = [_single_einsum(state, gid) for gid in gids]
        letter = state.unused_letter()
        first = einsums[0]
        terms, out = first.expr.split("->")[0].split(","), first.expr.split("->")[1]
        if kind == "input":
            k = members[0][1]
            stacked_terms = [t if j == k else letter + t for j, t in enumerate(terms)]
            expr = f"{','.join(stacked_terms)}->{letter}{out}"
            tensors = [tuple(e.inputs[j].tensor for e in einsums) for j in range(len(terms)) if j != k]
            tensors.append(tuple(e.output.tensor for e in einsums))
        else:
            expr = f"{','.join(letter + t for t in terms)}->{out}"
            tensors = [tuple(e.inputs[j].tensor for e in einsums) for j in range(len(terms))]
        stack = Stack(letter, len(einsums), tuple((e.name,) for e in einsums), tuple(tensors), expr)
        gid = state.merge(gids, self.name, stack)
        if kind == "sum":
            self._split_accumulation(state, state.prim[members[0][1]], [e.output.tensor for e in einsums], gid)

    @staticmethod
    def _split_accumulation(state, acc: Primitive, stacked: list[str], gid: int) -> None:
        letters = acc.output.letters
        rest = [op for op in acc.inputs if op.tensor not in stacked]
        if not rest:  # the whole sum is the stack's
            state.groups[state.owner[acc.name]].prims.remove(acc.name)
            state.groups = {g: grp for g, grp in state.groups.items() if grp.prims}
            state.groups[gid].prims.append(acc.name)
            state._index()
            return
        # one gradient may take two stacks' sums (Q/K/V and an MLP's gate and up reading one h): each its own partial
        name = next(n for k in range(len(state.graph.tensors) + 1)
                    if (n := f"{acc.output.tensor}_stacked{k or ''}") not in state.graph.tensors)
        partial = TensorInfo(name, state.graph.tensors[acc.output.tensor].letters, "intermediate")
        sum_stack = Primitive(f"map:{partial.name}", "map", tuple(Operand(t, letters) for t in stacked),
                              Operand(partial.name, letters), " + ".join(f"in{k}" for k in range(len(stacked))))
        inputs = tuple(rest) + (Operand(partial.name, letters),)
        remainder = Primitive(acc.name, "map", inputs, acc.output, " + ".join(f"in{k}" for k in range(len(inputs))))
        state.replace(acc.name, [sum_stack, remainder], [partial], [gid, state.owner[acc.name]])


class FuseNonContractions(Rule):
    """Pattern: two non-contraction, unstacked groups of one phase that share a tensor (one
    writes what the other reads, or both read it).  Legal: compatible iteration spaces aligned
    through that tensor, no cycle, and the minimal I/O does not grow.  Rewrite: merge them.
    Best first: the largest I/O saving, then program order."""

    name = "fuse-non-contractions"

    def candidates(self, state):
        eligible = {gid for gid, g in state.groups.items() if g.stack is None and state.cls(gid) != CONTRACTION}
        pairs = {}
        for tensor in state.graph.tensors:
            touching = [state.owner[state.producer[tensor]]] if tensor in state.producer else []
            touching += [state.owner[r] for r in state.readers.get(tensor, [])]
            touching = [g for g in dict.fromkeys(touching) if g in eligible]
            for n, a in enumerate(touching):
                for b in touching[n + 1:]:
                    if state.groups[a].phase == state.groups[b].phase:
                        key = tuple(sorted((a, b), key=state.first))
                        pairs.setdefault(key, tensor)
        ranked = []
        for (a, b), tensor in pairs.items():
            saving = state.group_io(a) + state.group_io(b) - state.group_io(a, b)
            ranked.append((-saving, state.first(a), state.first(b), a, b, tensor))
        return [(a, b, tensor, -neg) for neg, _, _, a, b, tensor in sorted(ranked)]

    def legal(self, state, match):
        a, b, tensor, saving = match
        return saving >= 0 and _compatible(state, a, b, tensor) and state.gathers_computable([a, b]) \
            and not state.creates_cycle([a, b])

    def rewrite(self, state, match):
        state.merge([match[0], match[1]], self.name)


class StackElementwise(Rule):
    """Pattern: for a stacked contraction, one non-contraction group per member touching that
    member's stacked tensor, all with the same structure.  Legal: one phase, mutually independent,
    no cycle.  Rewrite: one operator over the stack letter."""

    name = "stack-elementwise"

    def candidates(self, state):
        found = []
        for gid, group in list(state.groups.items()):
            if group.stack is None or state.cls(gid) != CONTRACTION:
                continue
            for stacked in group.stack.tensors:
                owners = []
                for tensor in stacked:
                    touching = [state.owner[state.producer[tensor]]] if tensor in state.producer else []
                    touching += [state.owner[r] for r in state.readers.get(tensor, [])]
                    touching = [g for g in dict.fromkeys(touching)
                                if g != gid and state.groups[g].stack is None and state.cls(g) != CONTRACTION]
                    if len(touching) != 1:
                        break
                    owners.append(touching[0])
                else:
                    found.append((group.stack.letter, tuple(owners), stacked))
        return found

    def legal(self, state, match):
        _, owners, stacked = match
        if len(set(owners)) != len(owners) or len({state.groups[g].phase for g in owners}) != 1:
            return False
        if len({_group_signature(state, g) for g in owners}) != 1:
            return False
        if any(len([t for t in stacked if t in set().union(*state.tensors_of(g))]) != 1 for g in owners):
            return False
        return not any(state.descendants(g) & set(owners) for g in owners) and not state.creates_cycle(list(owners))

    def rewrite(self, state, match):
        letter, owners, stacked = match
        members = tuple(tuple(state.groups[g].prims) for g in owners)
        state.merge(list(owners), self.name, Stack(letter, len(owners), members, (tuple(stacked),)))


def _sums_columns_of(state: FusionState, producer: int, tensor: str, letters: str, reduced: frozenset) -> bool:
    """Whether a reduction over ``reduced`` of ``tensor`` (read under ``letters``) sums the columns
    of a normalization ``producer`` writing it: one that reduces over the other letters (a
    layernorm backward's rows).  Such a sum runs best inside the producer's pass, which holds the
    tensor in registers (the candidates' column-sum joins, ``layouts.space.column_sum_joins``)."""
    if state.cls(producer) != NORMALIZATION or state.groups[producer].stack is not None:
        return False
    theirs = _access(state, producer, tensor)
    rename = dict(zip(letters, theirs))
    mine = {rename.get(l, l) for l in reduced}
    _, reductions = _space(state, producer)
    return any(r and not r & mine and r | mine == set(theirs) for r in reductions)


class JoinReductionAcrossContraction(Rule):
    """Pattern: a non-contraction group whose results nobody reads (e.g. a bias gradient) and
    which reduces over letters R; a contraction reads one of its input tensors, and a
    non-contraction group reads that contraction's output and reduces over the same letters
    (aligned through the contraction's letters).  Not where the tensor's producer is a
    normalization whose columns the group sums (``_sums_columns_of``: BERT's FFN output bias gradient
    stays beside its layernorm backward rather than joining the first bias gradient across the
    FFN's second GEMM).  Legal: one phase, no cycle, I/O not grown.
    Rewrite: merge the two (one launch for both reductions)."""

    name = "join-reduction-across-contraction"

    def candidates(self, state):
        found = []
        for gid, group in state.groups.items():
            if group.stack is not None or state.cls(gid) != NORMALIZATION:
                continue
            reads, writes = state.tensors_of(gid)
            if any(state.readers.get(t) for t in writes):
                continue
            _, reductions = _space(state, gid)
            if len(reductions) != 1:
                continue
            (reduced,) = reductions
            for tensor in reads:
                if tensor not in state.producer or state.phases[state.producer[tensor]] != group.phase:
                    continue
                mine = _access(state, gid, tensor)
                if _sums_columns_of(state, state.owner[state.producer[tensor]], tensor, mine, reduced):
                    continue
                for reader in state.readers.get(tensor, []):
                    c = state.owner[reader]
                    einsum = _single_einsum(state, c)
                    if einsum is None:
                        continue
                    theirs = next(op.letters for op in einsum.inputs if op.tensor == tensor)
                    rename = dict(zip(mine, theirs))
                    target = {rename.get(l, l) for l in reduced}
                    for other in state.readers.get(einsum.output.tensor, []):
                        b = state.owner[other]
                        if b == gid or state.groups[b].stack is not None or state.cls(b) == CONTRACTION:
                            continue
                        _, red_b = _space(state, b)
                        out_b = _access(state, b, einsum.output.tensor)
                        back = dict(zip(einsum.output.letters, out_b))
                        if red_b == {frozenset(back.get(l, l) for l in target)}:
                            found.append((gid, b))
        return found

    def legal(self, state, match):
        a, b = match
        return (state.groups[a].phase == state.groups[b].phase and not state.creates_cycle([a, b])
                and state.gathers_computable([a, b]) and state.group_io(a) + state.group_io(b) >= state.group_io(a, b))

    def rewrite(self, state, match):
        state.merge(list(match), self.name)


def _is_scaling(prim: Primitive) -> bool:
    """``in0 * c``, ``c * in0`` or ``in0 / c`` with ``c`` free of tensors."""
    return prim.kind == "map" and len(prim.inputs) == 1 and prim.expression.scale_of(0) is not None


class ScaleIntoContraction(Rule):
    """Pattern: a group that is one scaling map, whose input is a contraction's output read only
    by it, or whose output is read only by one contraction.  Legal: one phase, no cycle.
    Rewrite: merge the scaling into the contraction (the GEMM's alpha)."""

    name = "scale-into-contraction"

    def candidates(self, state):
        found = []
        for gid, group in state.groups.items():
            if len(group.prims) != 1 or not _is_scaling(state.prim[group.prims[0]]):
                continue
            prim = state.prim[group.prims[0]]
            source = state.producer.get(prim.inputs[0].tensor)
            if source is not None and state.cls(state.owner[source]) == CONTRACTION \
                    and state.readers[prim.inputs[0].tensor] == [prim.name]:
                found.append((gid, state.owner[source]))
            readers = state.readers.get(prim.output.tensor, [])
            if len(readers) == 1 and state.cls(state.owner[readers[0]]) == CONTRACTION \
                    and prim.output.tensor not in state.graph.outputs:
                found.append((gid, state.owner[readers[0]]))
        return found

    def legal(self, state, match):
        a, b = match
        return state.groups[a].phase == state.groups[b].phase and not state.creates_cycle([a, b])

    def rewrite(self, state, match):
        state.merge([match[1], match[0]], self.name, state.groups[match[1]].stack)


RULES: tuple[Rule, ...] = (StackContractions(), FuseNonContractions(), StackElementwise(),
                           JoinReductionAcrossContraction(), ScaleIntoContraction())


def fuse(training: TrainingGraph, rules: tuple[Rule, ...] = RULES) -> FusedGraph:
    """Apply ``rules`` to the training graph's operators until none applies."""
    state = FusionState(training)
    while any(rule.apply(state) for rule in rules):
        pass
    operators, merged, applied, stacks = [], {}, {}, {}
    taken: set[str] = set()
    for gid in state.topological():
        group = state.groups[gid]
        prims = [state.prim[n] for n in group.prims]
        op = make_operator(state.graph, prims, group.phase, cls=state.cls(gid))
        name = op.name
        if group.stack is not None:
            name = "stack(" + ",".join(state.prim[m[-1]].output.tensor for m in group.stack.members) + ")"
        base, n = name, 1
        while name in taken:
            name, n = f"{base}_{n}", n + 1
        taken.add(name)
        op = Operator(name, op.cls, op.phase, op.primitives, op.inputs, op.outputs)
        operators.append(op)
        merged[name] = tuple(group.merged)
        applied[name] = tuple(group.rules)
        if group.stack is not None:
            stacks[name] = group.stack
    return FusedGraph(training, state.graph, dict(state.phases), state.unfused, operators, merged, applied, stacks)
