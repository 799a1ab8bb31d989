"""Hill climbing over the knob settings of one access pattern of a fused operator.

A pattern's settings (tile rows and columns, warps, mode, programs, ...; ``Configuration.knobs``)
are not measured all at once: each round measures the settings next to the ``CLIMB_BEAM``
fastest found so far, and the climb ends when a round finds nothing new to measure.  Two
settings are next to each other when they differ in one knob (any value of it), or in two
numeric knobs each moved one step along that knob's values in the pattern (tile rows and warps
doubled together keep a thread's elements: the valleys of these grids run along such
diagonals).  Replayed on the recorded cold BERT-large tuning of an H200 that measured every
setting (``tests/tuning_replay.py``, ``tests/golden/bert_h200_tuning.json.gz``): the knob stages
measure 357 + 43 settings instead of 911 + 103, and the selection ends with the same plan.
"""
from __future__ import annotations

from datamove.harness.tuning_db import canonical_json

CLIMB_BEAM = 2  # the settings of a pattern whose neighbours a round measures


def numeric_steps(knob_sets: list[dict]) -> dict[str, dict]:
    """{knob: {value: its position among the knob's sorted values}} for the knobs whose values in
    ``knob_sets`` are all numbers (not booleans)."""
    values: dict[str, set] = {}
    other: set[str] = set()
    for knobs in knob_sets:
        for name, value in knobs.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                values.setdefault(name, set()).add(value)
            else:
                other.add(name)
    return {name: {v: n for n, v in enumerate(sorted(found))} for name, found in values.items() if name not in other}


def adjacent(a: dict, b: dict, steps: dict) -> bool:
    """Whether knob settings ``a`` and ``b`` are neighbours: one knob apart, or two knobs of
    ``steps`` (``numeric_steps``) each one step apart."""
    apart = [name for name in a.keys() | b.keys() if a.get(name) != b.get(name)]
    if len(apart) == 1:
        return True
    return len(apart) == 2 and all(name in steps and a.get(name) in steps[name] and b.get(name) in steps[name]
                                   and abs(steps[name][a[name]] - steps[name][b[name]]) == 1 for name in apart)


def next_round(groups: list[list], ranked, offered: set) -> list:
    """The variants to measure next: in each group (one access pattern's variants, ``knobs`` their
    settings), those not
    ``offered`` yet (keys, ``variant_key``; updated here) next to one of the group's ``CLIMB_BEAM``
    fastest measured (``ranked(group)``: measured variants, fastest first); a group with none
    measured starts from its first variant."""
    result = []
    for group in groups:
        steps = numeric_steps([v.knobs for v in group])
        beam = [v.knobs for v in ranked(group)[:CLIMB_BEAM]]
        for v in group[:1] if not beam else group:
            key = variant_key(v)
            if key not in offered and (not beam or any(adjacent(b, v.knobs, steps) for b in beam)):
                offered.add(key)
                result.append(v)
    return result


def variant_key(variant) -> tuple:
    """What tells a group's variants apart: the operator, its layouts and knob settings."""
    return (variant.op, canonical_json(variant.layout), canonical_json(variant.knobs))
