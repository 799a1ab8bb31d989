"""The candidates of every operator of a fused training graph, with their times, and the plan.

``plan_layer`` gathers, per operator of the fused graph (``dataflow.snapshot.FusedTraining``):

- generated element-wise / normalization kernels: one candidate per tensor-layout combination of
  ``layouts.space.configurations`` (pruned space), its knobs the fastest measured (else the
  representative's, predicted);
- contractions: each BLAS-mappable operand-layout combination (one batch dim at most; a stacked
  operand keeps its stack letter outermost: its members are views of one buffer), cuBLAS or the
  fastest measured Triton configuration, timed as the ``harness.contraction_variants.pick_layouts``
  plan that makes the same BLAS call (``same_call_layouts``: the same sizes and strides);
- a GEMM with each kernel family of ``datamove.families.GEMM_FAMILIES`` whose pattern it has
  (the residual add, the forward epilogue, the gradient epilogue): the family's candidates;
- a layernorm backward joined with the column sums beside it (``layouts.space.column_sum_joins``:
  its parameter gradients, a bias gradient of what it writes): one generated kernel, its
  candidates as a generated operator's, in place of the members';
- each family of ``datamove.families.GRAPH_FAMILIES`` whose pattern the graph has: the fused
  attention (``families.attention``), forward and backward in every layout the producer of its
  inputs can write, in place of the score contraction, softmax and output contraction and their
  backward operators (with its causal mask, the bias add before it, grouped-query attention's
  repeats: its module doc); the plan's fact under the family's name says whether it is offered,
  or why not;

times from ``Timings`` (the tuning database's records of one device and dtype) or the cost model
(``layouts.cost_model``, marked predicted); then ``layouts.select`` chooses.  Layout changes are
priced by ``Timings`` (``op="layout:<letters>"``) or the cost model.
"""
from __future__ import annotations

import itertools
import json
import math
from dataclasses import replace

from datamove.kernels.attention import KERNEL_ID as ATTENTION_ID
from datamove.kernels.contraction import parse
from datamove.kernels.gemm import TEMPLATE_ID
from datamove.kernels.gemm_join import JOIN_TEMPLATE_ID
from datamove.kernels.layout_change import KERNEL_ID as LAYOUT_CHANGE_ID
from datamove.families import ATTENTION, GEMM_FAMILIES, GRAPH_FAMILIES
from datamove.families.attention import AttentionRepeats, AttentionRoles, attention_candidates
from datamove.families.attention import attention_roles  # noqa: F401  (the recogniser, as the selection's callers name it)
from datamove.families.base import GemmSite, PlainLayout, execution_order as gemm_execution_order, gemm_config_of
from datamove.harness.contraction_variants import STACK_LETTERS, same_call_layouts, training_gemms
from datamove.harness.sweep_variants import moved_bytes, op_signature
from datamove.dtypes import Precision, parse as parse_dtype
from datamove.harness.tuning_db import canonical_json
from datamove.layouts.cost_model import DeviceFigures, predict_ms
from datamove.layouts.plan import GEMM, GENERATED, MEASURED, PREDICTED, Plan
from datamove.layouts.select import Candidate, best_sum, select, to_plan
from datamove.layouts.step_config import ContractionConfig, GeneratedConfig
from datamove.layouts.space import (column_sum_joins, configurations, default_configuration, join_members, masks_grouped,
                                    parts, representatives, size_one_first)

# candidates kept per operator run (fastest; ties: spec order first): bounds the search.  48: with
# cuBLASLt's other algorithms timed, BERT-large's 1024-wide GEMMs have 8 layouts within 0.3 us of each
# other, and at 16 the H100 plan lost the layouts shared by the three GEMMs reading the attention's
# output projection weight and paid a 9.5 us change (0.7776 ms against 0.7683 at 48; search 2 s)
KEEP_PER_OPERATOR = 48
COMPOSED_PER_PART = 3  # a multi-part operator's fastest measured layouts per part that ``composed`` combines


def _stale(key) -> bool:
    """Whether a tuning-database key times another version of its kernel's source than this one:
    a Triton GEMM configuration (knob ``template``, ``kernels.gemm.TEMPLATE_ID``; a join epilogue's,
    ``kernels.gemm_join.JOIN_TEMPLATE_ID``, which hashes the template too), the fused
    attention or a layout change (knob ``kernel``: ``kernels.attention.KERNEL_ID``,
    ``kernels.layout_change.KERNEL_ID``).  Generated kernels carry their generator's version in
    their key instead (``harness.sweep_variants``)."""
    knobs = key.knobs
    if knobs.get("backend") == "triton":
        return knobs.get("template") not in (TEMPLATE_ID, JOIN_TEMPLATE_ID)
    if key.op.startswith("attention:") and knobs.get("impl") == "fused":
        return knobs.get("kernel") != ATTENTION_ID
    if key.op.startswith("layout:"):
        return knobs.get("kernel") != LAYOUT_CHANGE_ID
    return False


class Timings:
    """Measured times by key, from tuning-database records of exactly one device and dtype (a
    ``dtypes.Precision`` in any spelling; None: no records at all, ``NO_TIMINGS``).

    A record of another device or dtype is refused (``ValueError`` naming both), never used; one
    of another version of the kernel's source (``_stale``) is left out.  A kernel whose every
    record failed or was wrong (``broken``) is not offered at a predicted time."""

    def __init__(self, records, device: str, dtype: Precision | str | None):
        self.device, self.dtype = device, None if dtype is None else parse_dtype(dtype)
        self.times: dict[tuple, list[tuple[float, dict]]] = {}  # fastest first
        self._broken: set[tuple] = set()  # keys with failed / wrong records and none ok
        for r in records:
            if r.key.device != device or self.dtype is None or r.key.dtype != self.dtype.name:
                raise ValueError(f"timing of {r.key.op} is from {r.key.device} / {r.key.dtype}; this selection is for "
                                 f"{device} / {self.dtype}: query the tuning database for this device and dtype only")
            if _stale(r.key):
                continue  # another version of the kernel was timed (the tuning measures this one again)
            key = _timing_key(r.key.op, r.key.dims, r.key.layout)
            if r.status in ("failed", "wrong"):
                self._broken.add(key)
            if r.status != "ok" or r.median_ms is None:
                continue
            self.times.setdefault(key, []).append((r.median_ms, r.key.knobs))
        self._broken -= self.times.keys()
        for found in self.times.values():
            found.sort(key=lambda pair: pair[0])
        # each key's knobs as canonical JSON, in the same order: ``exact`` compares strings, not encodings
        self._knobs_json = {key: [canonical_json(knobs) for _, knobs in found] for key, found in self.times.items()}
        self.changes_by_size: dict[int, list[float]] = {}  # elements -> each measured layout change's time, ascending
        for (op, dims, _), found in self.times.items():
            if op.startswith("layout:"):
                self.changes_by_size.setdefault(math.prod(json.loads(dims).values()), []).append(found[0][0])
        for times in self.changes_by_size.values():
            times.sort()

    def lookup(self, op: str, dims: dict, layout, accept=lambda knobs: True) -> tuple[float, dict] | None:
        """The fastest (ms, knobs) of ``op`` at ``dims`` in ``layout`` whose knobs ``accept`` allows."""
        found = self.times.get(_timing_key(op, dims, layout), [])
        return next((pair for pair in found if accept(pair[1])), None)

    def exact(self, op: str, dims: dict, config) -> tuple[float, dict] | None:
        """``lookup`` of ``config`` itself (a ``layouts.space.Configuration``): its layouts, its knobs."""
        key, knobs = _timing_key(op, dims, config.layouts), canonical_json(config.knobs)
        return next((pair for pair, text in zip(self.times.get(key, []), self._knobs_json.get(key, [])) if text == knobs),
                    None)

    def broken(self, op: str, dims: dict, layout) -> bool:
        """Whether ``op`` at ``dims`` in ``layout`` failed (build, launch, time limit) or was wrong on
        this device at every setting tried, and never ran correctly: no candidate then, not a
        cost-model guess at a kernel known not to run."""
        return _timing_key(op, dims, layout) in self._broken

    def fastest(self, op: str, dims: dict) -> float | None:
        """The fastest time of ``op`` at ``dims`` in any layout (PyTorch's baselines: one layout each)."""
        dims_key = canonical_json(dims)
        times = [found[0][0] for (name, d, _), found in self.times.items() if name == op and d == dims_key]
        return min(times) if times else None


def _timing_key(op: str, dims: dict, layout) -> tuple:
    """What ``Timings`` keeps its records by: the operator at its sizes in one layout (any knobs)."""
    return op, canonical_json(dims), canonical_json(layout)


NO_TIMINGS = Timings([], "", None)


def gemm_layouts(graph, op, g) -> tuple[dict, dict, list[tuple[dict, dict, tuple]]]:
    """(members, renames, layouts) of training GEMM ``g`` (``op``: its fused operator): ``members``
    {"a", "b", "out": [tensor, ...]} (a stacked operand's members), ``renames`` {tensor: {einsum
    letter: the tensor's own letter}}, and per layout combination its plan can run (a stacked
    operand's stack letter outermost) the tensors' reads and writes ({tensor: layout}) and the
    (a, b, out) storage orders it is timed as (``same_call_layouts``)."""
    einsums = [p for p in op.primitives if p.kind == "einsum"]
    stack = next((x for x in STACK_LETTERS if x in g.spec and x not in einsums[0].expr), None)
    members = {}
    for key, index in (("a", 0), ("b", 1)):
        tensors = [e.inputs[index].tensor for e in einsums]
        members[key] = tensors if len(set(tensors)) > 1 else tensors[:1]
    stacked_out = len(einsums) > 1 and (len(members["a"]) == 1 or len(members["b"]) == 1)
    members["out"] = [e.output.tensor for e in einsums] if stacked_out else list(op.outputs)
    # a member's own letters for the einsum's letters, axis by axis (every member has the
    # first's axes; the summed output, the first einsum's output's)
    first = {"a": einsums[0].inputs[0].letters, "b": einsums[0].inputs[1].letters, "out": einsums[0].output.letters}
    renames = {t: dict(zip(first[key], graph.tensors[t].letters)) for key, tensors in members.items() for t in tensors}
    result, seen = [], set()
    for plan_layouts, timed_as in same_call_layouts(g).items():
        layouts = dict(zip(("a", "b", "out"), plan_layouts))
        if any(len(members[k]) > 1 and layouts[k][0] != stack for k in layouts):
            continue  # a stacked operand's members are views of one buffer, stack letter outermost
        own = lambda t, k: size_one_first(graph, "".join(renames[t][x] for x in layouts[k] if x != stack))  # noqa: E731
        reads = {t: own(t, k) for k in ("a", "b") for t in members[k]}
        writes = {t: own(t, "out") for t in members["out"]}
        key = (canonical_json(reads), canonical_json(writes))
        if key not in seen:  # layouts apart only where a letter of size 1 sits: the same call
            seen.add(key)
            result.append((reads, writes, timed_as))
    return members, renames, result


class CandidateBuilder:
    """Candidates of one fused graph for one dtype, timed by ``timings`` or ``figures``."""

    def __init__(self, fused, spec: str, dtype: Precision | str, figures: DeviceFigures, timings: Timings):
        self.fused, self.spec, self.dtype, self.figures, self.timings = fused, spec, parse_dtype(dtype), figures, timings
        self.graph = fused.graph
        self.itemsize = self.dtype.itemsize
        self._changes: dict[tuple, tuple[float, str]] = {}
        self.order = execution_order(fused)  # the operators as the plan runs them

    def generated(self, op) -> list[Candidate]:
        graph = self.graph
        masks = {t for t in op.inputs if graph.tensors[t].role == "dropout"}
        groups: dict[str, list] = {}
        for config in configurations(graph, op):
            layouts = canonical_json({t: l for t, l in config.layouts.items() if t not in masks})
            groups.setdefault(layouts, []).append(config)
        flop = sum(graph.size(p.output.letters) for p in op.primitives if p.kind != "einsum")
        result = []
        grouped = masks_grouped(graph, op)
        for configs in groups.values():
            default = representatives(configs, grouped)[0]
            found = None
            for config in configs:
                hit = self.timings.exact(op_signature(self.spec, op), dict(graph.dim_values), config)
                if hit is not None and (found is None or hit[0] < found[0][0]):
                    found = (hit, config)
            if found is None and self.timings.broken(op_signature(self.spec, op), dict(graph.dim_values), default.layouts):
                continue
            ms, source, _ = self.time(found[0] if found else None, "generated", flop,
                                       moved_bytes(graph, op, self.itemsize))
            config = found[1] if found else default
            reads = {t: config.layouts[t] for t in op.inputs if t not in masks}
            writes = {t: config.layouts[t] for t in op.outputs}
            result.append(Candidate(op.name, op.phase, GENERATED, (op.name,), reads, writes,
                                    GeneratedConfig(config.knobs, {t: config.layouts[t] for t in masks}), ms, source))
        return result

    def composed(self, op, written: dict[str, set]) -> list[Candidate]:
        """An operator of several parts (``layouts.space.parts``) with each part at its own best.

        Its space holds the all-default configuration and each part varied with the others at their
        defaults (rule 5 of ``layouts.space``), so no measured configuration has two parts away from
        their defaults, and a stacked producer's layouts (GPT-2's Q/K/V gradients, all h-outermost)
        match none: the plan paid layout changes to reach one.  Per part, the layouts of its
        ``COMPOSED_PER_PART`` fastest variations and, per combination of layouts that ``written``
        says some candidate writes its inputs in ({tensor: layouts}), the fastest reading them so,
        each with its fastest knobs; every combination of two or more parts away from their
        defaults, priced as the measured all-default time plus each part's measured difference to
        it (parts run in disjoint programs), no faster than the cost model, marked ``composed`` (so
        kept beside measurements, and measured once a plan takes it, then tuned part by part:
        ``datamove.tuning.chosen_patterns``).  Once measured, the fastest measured setting of its
        layouts; none where it only failed.  None without a measured all-default configuration."""
        split = parts(op)
        if len(split) < 2:
            return []
        graph, dims, signature = self.graph, dict(self.graph.dim_values), op_signature(self.spec, op)
        base = default_configuration(graph, op)
        base_found = self.timings.exact(signature, dims, base)
        if base_found is None:
            return []
        base_ms = base_found[0]
        masks = {t for t in op.inputs if graph.tensors[t].role == "dropout"}
        tensors = [[t for t in base.layouts if t in (*part.inputs, *part.outputs)] for part in split]

        def own(config, k) -> str:
            return canonical_json([{t: config.layouts[t] for t in tensors[k]}, config.knobs["parts"][k]])

        options: list[dict] = [{} for _ in split]  # per part: its layouts -> (fastest ms, that configuration)
        for config in configurations(graph, op):
            away = [k for k in range(len(split)) if own(config, k) != own(base, k)]
            if len(away) != 1:
                continue
            found = self.timings.exact(signature, dims, config)
            k = away[0]
            layouts = canonical_json({t: config.layouts[t] for t in tensors[k]})
            if found is not None and (layouts not in options[k] or found[0] < options[k][layouts][0]):
                options[k][layouts] = (found[0], config)
        chosen = []
        for k, part in enumerate(split):
            default = canonical_json({t: base.layouts[t] for t in tensors[k]})
            ranked = sorted(options[k].items(), key=lambda item: item[1][0])
            matching: dict[str, str] = {}  # the layouts of its written inputs -> the fastest option reading them so
            for layouts, (_, config) in ranked:
                read = {t: config.layouts[t] for t in part.inputs if t in written}
                if all(layout in written[t] for t, layout in read.items()):
                    matching.setdefault(canonical_json(read), layouts)
            keep = {layouts for layouts, _ in ranked[:COMPOSED_PER_PART]} | set(matching.values())
            chosen.append([(None, base_ms, base)] + [(layouts, *options[k][layouts]) for layouts in sorted(keep)
                                                    if layouts != default])
        flop = sum(graph.size(p.output.letters) for p in op.primitives if p.kind != "einsum")
        floor, _, _ = self.time(None, "generated", flop, moved_bytes(graph, op, self.itemsize))
        result = []
        for combination in itertools.product(*chosen):
            if sum(layouts is not None for layouts, _, _ in combination) < 2:
                continue  # the base, or one part varied: measured as it is
            layouts = {t: config.layouts[t] for k, (_, _, config) in enumerate(combination) for t in tensors[k]}
            own_knobs = tuple(config.knobs["parts"][k] for k, (_, _, config) in enumerate(combination))
            slowest = max(combination, key=lambda option: option[1])[2]
            warps = sorted({config.knobs["num_warps"] for _, _, config in combination})
            knobs = {"parts": own_knobs, "num_warps": slowest.knobs["num_warps"], "dropout": base.knobs["dropout"]}
            found = self.timings.lookup(signature, dims, layouts,
                                        lambda k, w=canonical_json(own_knobs): canonical_json(k.get("parts")) == w)
            if found is not None:  # measured: its fastest setting of these layouts (the main job tunes around it)
                (ms, knobs), source = self.timings.lookup(signature, dims, layouts), MEASURED
            elif self.timings.broken(signature, dims, layouts):
                continue
            else:
                ms, source = max(floor, base_ms + sum(option_ms - base_ms for _, option_ms, _ in combination)), PREDICTED
            reads = {t: layouts[t] for t in op.inputs if t not in masks}
            writes = {t: layouts[t] for t in op.outputs}
            result.append(Candidate(op.name, op.phase, GENERATED, (op.name,), reads, writes,
                                    GeneratedConfig(knobs, {t: layouts[t] for t in masks}, tuple(warps)), ms, source))
        return result

    def time(self, found, family: str, flop: float, bytes_moved: float, **extra) -> tuple[float, str, dict | None]:
        """(ms, source, knobs): ``found``'s (a tuning-database hit), else the cost model's prediction."""
        if found is not None:
            return found[0], MEASURED, found[1]
        return predict_ms(self.figures, family, flop=flop, bytes_moved=bytes_moved, dtype=self.dtype, **extra), PREDICTED, None

    def gemms(self) -> dict[str, list[Candidate]]:
        """Per training GEMM, its plain candidates (run ``<gemm>``) and those of each family of
        ``GEMM_FAMILIES`` whose pattern it has, where the pattern's consumer runs right after it
        (run ``<gemm>+<family>``)."""
        ops = {op.name: op for op in self.fused.operators}
        result: dict[str, list[Candidate]] = {}
        for g in training_gemms(self.fused):
            op = ops[g.name]
            c = parse(g.spec)
            members, renames, layouts_of = gemm_layouts(self.graph, op, g)
            candidates, plain = [], []
            for reads, writes, timed_as in layouts_of:
                found = self.timings.lookup(g.op, g.sizes, dict(zip(("a", "b", "out"), timed_as)))
                if found is None and self.timings.broken(g.op, g.sizes, dict(zip(("a", "b", "out"), timed_as))):
                    continue
                ms, source, knobs = self.time(found, "gemm", g.flop, self.itemsize * sum(
                    math.prod(g.sizes[x] for x in letters) for letters in (c.a, c.b, c.out)))
                backend = (knobs or {}).get("backend", "cublas")
                gemm_config = gemm_config_of(knobs) if backend == "triton" else None
                algorithm = (knobs or {}).get("algorithm", 0) if backend == "cublas" else 0
                candidates.append(Candidate(g.name, op.phase, GEMM, (g.name,), reads, writes,
                                            ContractionConfig(g.spec, backend, members, gemm_config, algorithm), ms, source))
                plain.append(PlainLayout(reads, writes, timed_as, found is not None))
            result[g.name] = candidates
            site = GemmSite(g, op, members, renames, plain)
            for family in GEMM_FAMILIES:
                pattern = family.match(self.fused, g)
                if pattern is not None and self._follows(g, family.consumer(pattern)):
                    found = family.candidates(self, site, pattern)
                    if found:
                        result[f"{g.name}+{family.name}"] = found
        return result

    def _follows(self, g, consumer: str) -> bool:
        """Whether ``consumer`` runs right after ``g`` in ``execution_order`` (which moves it there
        where nothing between writes what it reads): a candidate covering both runs a contiguous
        run of operators (``layouts.select``)."""
        return self.order.index(consumer) == self.order.index(g.name) + 1

    def attention(self, roles: AttentionRoles, q_layouts: set[str], bias: dict | None = None,
                  repeats: AttentionRepeats | None = None) -> list[Candidate]:
        """The fused attention's candidates timed by this builder
        (``families.attention.attention_candidates``): what its family offers, here where a caller
        can wrap it."""
        return attention_candidates(self, roles, q_layouts, bias, repeats)

    def layout_change(self, tensor: str, source: str, target: str) -> tuple[float, str]:
        """(ms, source) of copying ``tensor`` from layout ``source`` to ``target`` (asked for once per
        edge of the search: kept per triple)."""
        key = (tensor, source, target)
        if key not in self._changes:
            self._changes[key] = self._layout_change(tensor, source, target)
        return self._changes[key]

    def _layout_change(self, tensor: str, source: str, target: str) -> tuple[float, str]:
        """Measured, else predicted: the cost model's copy time, or the median of the changes measured
        on tensors of this size where that is slower (a tiled transpose runs near one speed whatever
        the permutation; the model's bandwidth is a ceiling it does not reach)."""
        letters = self.graph.tensors[tensor].letters
        elements = self.graph.size(letters)
        found = self.timings.lookup(f"layout:{letters}", {x: self.graph.size(x) for x in letters},
                                    {"from": source, "to": target})
        ms, source_kind, _ = self.time(found, "copy", 0.0, 2 * elements * self.itemsize)
        measured = self.timings.changes_by_size.get(elements) if found is None else None
        if measured:
            ms = max(ms, measured[len(measured) // 2])
        return ms, source_kind


def _keep(candidates: list[Candidate], spec_letters: dict) -> list[Candidate]:
    """The ``KEEP_PER_OPERATOR`` fastest, measured ones only where any was measured (a prediction
    must not beat a measurement by optimism); among equal times, those closest to spec order first."""
    return _ranked(candidates, spec_letters)[:KEEP_PER_OPERATOR]


def _ranked(candidates: list[Candidate], spec_letters: dict) -> list[Candidate]:
    """``_keep``'s order: measured ones only where any was measured, fastest first, then closest to spec order."""
    def distance(c: Candidate) -> int:
        return sum(layout != spec_letters.get(t, layout) for t, layout in {**c.reads, **c.writes}.items())
    measured = [c for c in candidates if c.source == MEASURED or (c.kind == GENERATED and c.config.composed)]
    return sorted(measured or candidates, key=lambda c: (round(c.time_ms, 6), distance(c)))


def _kept_runs(runs: dict[str, list[Candidate]], order: list[str], spec_letters: dict) -> list[Candidate]:
    """The candidates the search gets: per operator run, ``_keep``'s; for every kept candidate
    before it that writes what it reads, the fastest one reading all of that in the layouts written;
    then, for every kept candidate after it that reads what it writes, the fastest one writing that
    in the layouts read.

    Without the second rule, an operator with hundreds of layout variants within a few percent of
    each other (an element-wise one) can lose every variant matching its producer's layouts to faster
    ones that each need a layout change costing far more than the difference (BERT-large at B=96
    L=128: the Q/K/V bias add's variant in the stacked GEMM's layouts ranked below the 16 kept, and
    the plan paid 0.10 ms of changes to save 0.001 ms).  The third is the same for a producer: on
    an H100 the output projection's GEMM wrote ``ibj`` in its kept variants (17.8 us, 32 of them
    within 0.5 us), and the plan paid a 9.3 us change to the ``bji`` its LayerNorm reads."""
    position = {name: n for n, name in enumerate(order)}
    ordered = sorted((cs for cs in runs.values() if cs), key=lambda cs: position[cs[0].operators[0]])
    ranked_by_run = [_ranked(cs, spec_letters) for cs in ordered]
    kept_by_run: list[list[Candidate]] = []
    for ranked in ranked_by_run:
        kept = ranked[:KEEP_PER_OPERATOR]
        _add_matches(kept, ranked, [c for run in kept_by_run for c in run], "reads", "writes")
        kept_by_run.append(kept)
    for n, ranked in enumerate(ranked_by_run):
        written: dict[str, set] = {}  # what the kept candidates before this run write
        for c in (c for run in kept_by_run[:n] for c in run):
            for t, layout in c.writes.items():
                written.setdefault(t, set()).add(layout)
        # among those writing a consumer's layouts, first those reading what is written before them
        preferred = sorted(ranked, key=lambda c: not all(layout in written[t]
                                                         for t, layout in c.reads.items() if t in written))
        _add_matches(kept_by_run[n], preferred, [c for run in kept_by_run[n + 1:] for c in run], "writes", "reads")
    return [c for run in kept_by_run for c in run]


def _add_matches(kept: list[Candidate], ranked: list[Candidate], others: list[Candidate], mine: str, theirs: str) -> None:
    """Append to ``kept`` the first of ``ranked`` whose ``mine`` ("reads" / "writes") layouts equal
    the ``theirs`` layouts of each of ``others`` on the tensors both name, where one does."""
    names = {t for c in ranked for t in getattr(c, mine)}
    for other in others:
        shared = {t: layout for t, layout in getattr(other, theirs).items() if t in names}
        match = next((c for c in ranked if shared and all(getattr(c, mine).get(t) == l for t, l in shared.items())), None)
        if match is not None and match not in kept:
            kept.append(match)


def execution_order(fused) -> list[str]:
    """The fused graph's operators as the plan runs them (``families.base.execution_order`` with
    ``GEMM_FAMILIES``: a family's moved consumer right after its GEMM)."""
    return gemm_execution_order(fused, GEMM_FAMILIES)


def attention_repeats(fused, roles: AttentionRoles) -> AttentionRepeats | None:
    """Grouped-query attention around ``roles`` in this order (the registered attention family's
    ``AttentionFamily.repeats``)."""
    return ATTENTION.repeats(fused, roles)


def plan_layer(fused, spec: str, *, dtype: Precision | str, figures: DeviceFigures, timings: Timings = NO_TIMINGS,
               boundary: dict | None = None, device: str | None = None) -> Plan:
    """Select the plan of ``fused`` (see the module doc).  ``boundary``: {tensor -> layout} fixed
    from outside (the layer's activations, outputs and their gradients in PyTorch's order)."""
    graph = fused.graph
    builder = CandidateBuilder(fused, spec, dtype, figures, timings)
    spec_letters = {t: info.letters for t, info in graph.tensors.items()}
    runs: dict[str, list[Candidate]] = {}
    for op in fused.operators:
        if op.cls != "contraction":
            runs[op.name] = builder.generated(op)
    for join in column_sum_joins(graph, fused.operators):  # run as one kernel: the members' names
        members = join_members(join, fused.operators)
        runs[join.name] = [replace(c, operators=members) for c in builder.generated(join)]
    runs.update(builder.gemms())
    family_facts = {}
    for family in GRAPH_FAMILIES:  # the fused attention (``datamove.families``)
        pattern, why = family.match(fused)
        if pattern is not None:
            for run, offered in family.offer(builder, pattern, runs, lambda cs: _keep(cs, spec_letters)).items():
                runs.setdefault(run, []).extend(offered)
        family_facts[family.name] = family.fact(pattern, why)
    for run, offered in runs.items():  # a letter of size 1 outermost: each memory layout one name (``size_one_first``)
        runs[run] = [replace(c, reads={t: size_one_first(graph, l) for t, l in c.reads.items()},
                             writes={t: size_one_first(graph, l) for t, l in c.writes.items()}) for c in offered]
    written: dict[str, set] = {}
    for c in (c for cs in runs.values() for c in cs):
        for t, layout in c.writes.items():
            written.setdefault(t, set()).add(layout)
    for op in fused.operators:
        if op.cls != "contraction":
            runs[op.name] += builder.composed(op, written)
    order = builder.order
    candidates = _kept_runs(runs, order, spec_letters)
    missing = [op.name for op in fused.operators if not any(op.name in c.operators for c in candidates)]
    if missing:
        raise ValueError(f"operators without a candidate that runs: {', '.join(missing)}")
    boundary = {t: size_one_first(graph, layout) for t, layout in (boundary or {}).items()}
    outputs = tuple(t for t, info in graph.tensors.items() if info.role in ("output", "gradient"))
    produced = {t for op in fused.operators for t in op.outputs} | {t for c in candidates for t in c.writes}
    steps, facts = select(order, candidates, produced=produced, boundary=boundary, change_cost=builder.layout_change,
                          outputs=outputs)
    facts.update(family_facts)
    plan = to_plan(steps, facts, spec=spec, dims=dict(graph.dim_values), dtype=dtype,
                   device=device or f"cost model: {figures.name}", layouts_of_inputs=boundary,
                   total_best=best_sum(order, candidates))
    for t, info in graph.tensors.items():  # what no step reads (a shuffle's constant) the layer stores in spec order
        if info.role == "constant":
            plan.layouts.setdefault(t, info.letters)
    return plan
