"""Configuration selection: one layout graph for the whole training graph, solved by shortest path.

After Ivanov et al., Sec. VI-B, without their two simplifications: residual connections stay
(a tensor read later, the residual input or anything saved for the backward, keeps its layout in
the search state until its last reader), and forward and backward are one search.

Input: the fused training graph's operators in execution order, and ``Candidate``s, each covering
a contiguous run of them (one operator; a GEMM with its element-wise consumer; the fused
attention's forward or backward operators) with the layouts it reads and writes and its time.

The layout graph: a node is (position in the operator order, state); the state holds the layout
of every tensor in memory that a later candidate may read (layer inputs once their layout is
decided, tensors written so far), and the layouts a layout change copied it to (a copy serves
every later reader, the backward's too).  An edge is a candidate starting at the node's position
whose reads are all available: it costs its time plus a layout change for every tensor it reads in
a layout the state does not hold (``change_cost``), and leads to the position after its last
operator with the state updated (written tensors added, tensors no later candidate reads
dropped).  A tensor no chosen candidate wrote is absent: a backward reading the attention's
probabilities cannot follow the fused attention, whose backward needs the statistics only the
fused forward writes.  Layer inputs without a fixed ``boundary`` layout (parameters) take the
layout of their first reader at no cost (they are stored that way); boundary tensors (the layer's
activations and outputs, exchanged with PyTorch) are fixed, and an output written in another
layout pays the change.  A* from the start node to position ``len(order)``, expanding the graph
lazily (a node's edges are generated when it is settled), guided by the cheapest cover of the
remaining operators with layouts ignored (a lower bound, so the path found is the shortest): only
states within the plan's gap to the sum of per-operator bests are settled.  (Building the whole
graph first with ``networkx`` reached 25-340 thousand states, seconds to minutes.)

Bounds: per operator run, only the fastest candidate of each (reads, writes) layout signature is
kept (the others are dominated); the state holds only tensors read again later.  ``Plan.search``
reports the states reached, settled and the edges explored.
"""
from __future__ import annotations

import heapq
import itertools
import time
from dataclasses import dataclass
from typing import Callable

from datamove.dtypes import Precision
from datamove.layouts.plan import LAYOUT_CHANGE, MEASURED, PREDICTED, Plan, Step
from datamove.layouts.step_config import LayoutChangeConfig, StepConfig

# layout states kept per position of the execution order: bounds the search.  At 512 the Llama-1B
# layer's warm selection took 3-4 s (134k states at its H200 timings); 256 and 128 gave the same plans
# there, at Llama-8B's, in the BERT replay and for every shipped spec's cost-model plan (2026-11-28)
STATES_PER_POSITION = 256


@dataclass(frozen=True)
class Candidate:
    """One way to run ``operators`` (a contiguous run of the execution order) as one kernel.

    ``kind`` / ``config``: as ``layouts.plan.Step``; ``reads`` / ``writes``: {tensor -> layout}
    (tensors of the graph, or of the plan only, such as the attention's statistics);
    ``time_ms`` and its ``source`` ("measured" / "predicted")."""

    name: str
    phase: str
    kind: str
    operators: tuple[str, ...]
    reads: dict
    writes: dict
    config: StepConfig
    time_ms: float
    source: str

    def signature(self) -> tuple:
        return (self.operators, tuple(sorted(self.reads.items())), tuple(sorted(self.writes.items())))


class NoPlan(ValueError):
    """No consistent choice covers the graph; the message names where the search got stuck."""


def prune(candidates: list[Candidate]) -> list[Candidate]:
    """The fastest candidate per (operators, reads, writes) signature (ties: first given)."""
    best: dict[tuple, Candidate] = {}
    for c in candidates:
        key = c.signature()
        if key not in best or c.time_ms < best[key].time_ms:
            best[key] = c
    return list(best.values())


def _last_reads(order: list[str], candidates: list[Candidate]) -> dict[str, int]:
    """Per tensor: the index of the last operator of the last candidate that may read it."""
    position = {name: n for n, name in enumerate(order)}
    last: dict[str, int] = {}
    for c in candidates:
        end = position[c.operators[-1]]
        for t in c.reads:
            last[t] = max(last.get(t, -1), end)
    return last


def select(order: list[str], candidates: list[Candidate], *, produced: set[str], boundary: dict[str, str],
           change_cost: Callable[[str, str, str], tuple[float, str]], outputs: tuple[str, ...] = ()) -> tuple[list, dict]:
    """The cheapest consistent sequence of candidates covering ``order``.

    ``produced``: tensors some operator writes (the rest are layer inputs: free at first read unless
    in ``boundary``); ``outputs``: tensors leaving the layer (their boundary layout is paid for).
    Returns (steps, search facts): steps as ``(candidate | None, change)`` pairs in order, a change
    being ``(tensor, from, to, ms, source)`` inserted before its reader (or after its writer for an
    output).

    The search is A* over (position, layouts of the live tensors); every node at one position has
    the same heuristic, so they are settled in order of distance and the first
    ``STATES_PER_POSITION`` settled there are the best ones: later ones are dropped (exact whenever
    no position fills up; ``facts["dropped"]`` counts the nodes dropped)."""
    started = time.monotonic()
    candidates = prune(candidates)
    position = {name: n for n, name in enumerate(order)}
    starting: dict[int, list[Candidate]] = {}
    for c in candidates:
        ends = [position[o] for o in c.operators]
        if ends != list(range(ends[0], ends[0] + len(ends))):
            raise ValueError(f"candidate {c.name}: operators {c.operators} are not contiguous in the execution order")
        starting.setdefault(ends[0], []).append(c)
    last = _last_reads(order, candidates)
    remaining = _cheapest_rest(order, candidates)  # admissible A* heuristic: the rest at its best, layouts ignored
    start = (0, ())
    settled: set = set()
    came_from: dict = {start: None}
    best = {start: 0.0}
    queue = [(remaining[0], 0, start)]
    pushed, edges = 1, 0
    stuck: dict[int, list[str]] = {}
    reached, goal = 0, None
    settled_at: dict[int, int] = {}
    dropped = 0
    while queue:
        _, _, node = heapq.heappop(queue)
        if node in settled:
            continue
        index, state = node
        if settled_at.get(index, 0) >= STATES_PER_POSITION:
            dropped += 1
            continue
        settled_at[index] = settled_at.get(index, 0) + 1
        distance = best[node]
        settled.add(node)
        reached = max(reached, index)
        if index == len(order):
            goal = node
            break
        for c, cost, changes, target, reason in _edges(node, starting.get(index, []), position, last, produced,
                                                       boundary, outputs, change_cost):
            if reason:
                stuck.setdefault(index, []).append(reason)
                continue
            edges += 1
            if distance + cost < best.get(target, float("inf")):
                best[target] = distance + cost
                came_from[target] = (node, c, changes)
                heapq.heappush(queue, (distance + cost + remaining[target[0]], pushed, target))
                pushed += 1
    if goal is None:
        why = "; ".join(sorted(set(stuck.get(reached, []))))[:600] or "no candidate starts there"
        raise NoPlan(f"no consistent plan: the search stops before operator {order[reached]!r} ({why})")
    chosen = []
    while came_from[goal] is not None:
        goal, c, changes = came_from[goal]
        chosen.append((c, changes))
    facts = {"operators": len(order), "candidates": len(candidates), "states": len(best), "settled": len(settled),
             "edges": edges, "dropped": dropped, "seconds": round(time.monotonic() - started, 3)}
    return chosen[::-1], facts


def _edges(node, candidates, position, last, produced, boundary, outputs, change_cost):
    """(candidate, cost, changes, target node, reason it cannot run or None) of every candidate from ``node``.

    The state holds, per tensor, the layout it is stored in and then the layouts earlier layout
    changes copied it to (the runtime keeps a copy under ``copy_name`` until its last reader, across
    the forward and backward: ``runtime.layer``'s kept tensors): a later reader of a copied layout
    pays nothing."""
    index, state = node
    held = dict(state)
    for c in candidates:
        cost, changes, reason, copied = c.time_ms, [], None, {}
        for t, layout in c.reads.items():
            if t in held:
                stored = held[t]
            elif t in boundary:
                stored = (boundary[t],)
            elif t not in produced:
                stored = (layout,)  # a parameter: stored as its first reader wants it
            else:
                reason = f"{c.name} reads {t}, which no chosen kernel before it writes"
                break
            if layout not in stored:
                ms, source = change_cost(t, stored[0], layout)
                cost += ms
                changes.append((t, stored[0], layout, ms, source))
                copied[t] = layout
        if reason:
            yield c, 0.0, [], None, reason
            continue
        end = position[c.operators[-1]] + 1
        new = {t: l for t, l in held.items() if last.get(t, -1) >= end}
        for t, layout in c.reads.items():  # inputs decided here stay decided
            if t not in produced and last.get(t, -1) >= end:
                new.setdefault(t, (boundary.get(t, layout),))
        for t, layout in copied.items():  # a copy serves later readers too
            if t in new:
                new[t] = (new[t][0], *sorted({*new[t][1:], layout}))
        for t, layout in c.writes.items():
            if t in outputs and t in boundary and boundary[t] != layout:
                ms, source = change_cost(t, layout, boundary[t])
                cost += ms
                changes.append((t, layout, boundary[t], ms, source))
            if last.get(t, -1) >= end:
                new[t] = (layout,)
        yield c, cost, changes, (end, tuple(sorted(new.items()))), None


def _cheapest_rest(order: list[str], candidates: list[Candidate]) -> list[float]:
    """Per position: the cheapest cover of the operators from there on, layouts ignored."""
    position = {name: n for n, name in enumerate(order)}
    rest = [float("inf")] * len(order) + [0.0]
    for index in range(len(order) - 1, -1, -1):
        for c in candidates:
            if position[c.operators[0]] == index:
                rest[index] = min(rest[index], c.time_ms + rest[index + len(c.operators)])
    return rest


def best_sum(order: list[str], candidates: list[Candidate]) -> float:
    """The cheapest cover of ``order`` by candidates ignoring layouts (each at its best time): the
    sum of per-operator bests the paper compares its plan with."""
    return _cheapest_rest(order, candidates)[0]


def to_plan(steps: list, facts: dict, *, spec: str, dims: dict, dtype: Precision | str, device: str, layouts_of_inputs: dict,
            total_best: float) -> Plan:
    """The chosen candidates and layout changes as a ``layouts.plan.Plan``."""
    plan_steps: list[Step] = []
    written = {t for candidate, _ in steps for t in candidate.writes}
    layouts = {t: layout for t, layout in layouts_of_inputs.items() if t not in written}  # outputs: as written
    for candidate, changes in steps:
        written_here = set(candidate.writes)
        before = [ch for ch in changes if ch[0] not in written_here]
        after = [ch for ch in changes if ch[0] in written_here]
        for t, source_layout, target, ms, source in before:
            plan_steps.append(_change_step(t, source_layout, target, ms, source, candidate.phase, len(plan_steps)))
        plan_steps.append(Step(candidate.name, candidate.phase, candidate.kind, candidate.operators, dict(candidate.reads),
                               dict(candidate.writes), candidate.config, candidate.time_ms, candidate.source))
        for t, layout in itertools.chain(candidate.reads.items(), candidate.writes.items()):
            layouts.setdefault(t, layout)
        for t, source_layout, target, ms, source in after:
            plan_steps.append(_change_step(t, source_layout, target, ms, source, candidate.phase, len(plan_steps)))
    forward_written = {t for s in plan_steps if s.phase == "forward" for t in s.writes}
    saved = sorted({t for s in plan_steps if s.phase == "backward" for t in s.reads if t in forward_written})
    sources = {s.source for s in plan_steps}
    timing = MEASURED if sources == {MEASURED} else PREDICTED if sources == {PREDICTED} else "mixed"
    total = sum(s.time_ms for s in plan_steps)
    return Plan(spec, dict(dims), dtype, device, timing, layouts, plan_steps, saved, total, total_best, facts)


def _change_step(tensor: str, source_layout: str, target: str, ms: float, source: str, phase: str, n: int) -> Step:
    return Step(f"layout({tensor}:{source_layout}->{target})#{n}", phase, LAYOUT_CHANGE, (), {tensor: source_layout},
                {}, LayoutChangeConfig(tensor, source_layout, target), ms, source)
