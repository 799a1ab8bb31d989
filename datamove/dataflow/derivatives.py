"""Which activation's derivative a map of the graph multiplies by, found numerically.

A backward graph spells an activation's derivative as a map of two inputs, the incoming gradient
times a function of a saved tensor: BERT's ReLU backward through its dropout,
``in0 * (in1 > 0) * scale_drop_act``; GPT-2's tanh-GELU backward as the chain rule's full
expression.  ``derivative`` evaluates the map on a probe (float64) and compares.
"""
from __future__ import annotations

import math

import numpy as np

from datamove.dataflow.executor import FUNCTIONS

DERIVATIVE_PROBE = np.linspace(-6.0, 6.0, 121)  # where a map's factor is compared with each derivative
_C = math.sqrt(2.0 / math.pi)
_T = np.tanh(_C * (DERIVATIVE_PROBE + 0.044715 * DERIVATIVE_PROBE ** 3))
GELU_DERIVATIVE = 0.5 * (1 + _T) + 0.5 * DERIVATIVE_PROBE * (1 - _T ** 2) * _C * (1 + 3 * 0.044715 * DERIVATIVE_PROBE ** 2)


def derivative(expr: str, position: int, namespace: dict) -> tuple[str, float] | None:
    """("relu", scale) or ("gelu", 1.0) when the map ``expr`` of two inputs is ``in<position>``
    times a function of the other that equals, at every point of ``DERIVATIVE_PROBE`` (float64),
    ReLU's derivative times a positive constant (0 at 0) or tanh-GELU's (relative 1e-9); else None."""
    other = 1 - position
    values = []
    for times in (1.0, 2.0):
        arguments = {f"in{position}": np.full_like(DERIVATIVE_PROBE, times), f"in{other}": DERIVATIVE_PROBE}
        with np.errstate(all="ignore"):
            value = eval(expr, {"__builtins__": {}}, {**namespace, **FUNCTIONS, **arguments})  # noqa: S307
        values.append(np.broadcast_to(np.asarray(value, dtype=np.float64), DERIVATIVE_PROBE.shape))
    once, twice = values
    if not (np.all(np.isfinite(once)) and np.allclose(twice, 2 * once, rtol=1e-12, atol=0.0)):
        return None
    positive = once[DERIVATIVE_PROBE > 0]
    scale = float(positive[0])
    if scale > 0 and np.all(np.abs(positive - scale) <= 1e-12 * scale) and np.all(once[DERIVATIVE_PROBE <= 0] == 0):
        return "relu", scale
    if np.all(np.abs(once - GELU_DERIVATIVE) <= 1e-9 * np.maximum(np.abs(GELU_DERIVATIVE), 1.0)):
        return "gelu", 1.0
    return None
