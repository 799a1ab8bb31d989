"""Which activation, or which activation's derivative, a map of the graph computes, found numerically.

A spec spells an activation its own way (ReLU as ``maximum(x, 0)``, tanh-GELU in one expression or
a chain of maps), and a backward graph spells an activation's derivative as a map of two inputs,
the incoming gradient times a function of a saved tensor: BERT's ReLU backward through its dropout,
``in0 * (in1 > 0) * scale_drop_act``; GPT-2's tanh-GELU backward as the chain rule's full
expression.  Maps are evaluated on one probe (float64) and compared with the GEMM template's
activations (``kernels.gemm``) and their derivatives: ``activation`` (a chain's value) and
``derivative`` (a map of two inputs).
"""
from __future__ import annotations

import math

import numpy as np

from datamove.dataflow.expression import Expression, parse

PROBE = np.linspace(-6.0, 6.0, 121)  # where a map is compared with each activation and derivative
_C = math.sqrt(2.0 / math.pi)
_T = np.tanh(_C * (PROBE + 0.044715 * PROBE ** 3))
ACTIVATIONS = {"relu": np.maximum(PROBE, 0.0), "gelu": 0.5 * PROBE * (1.0 + _T)}  # the template's, on the probe
GELU_DERIVATIVE = 0.5 * (1 + _T) + 0.5 * PROBE * (1 - _T ** 2) * _C * (1 + 3 * 0.044715 * PROBE ** 2)
RELATIVE = 1e-9  # how close to an activation's or a derivative's values a map must come


def evaluate(expr: str | Expression, arguments: dict, namespace: dict) -> np.ndarray:
    """``expr`` (a map's expression over ``in0``, ``in1``, ..: its text or its tree,
    ``Primitive.expression``) on ``arguments`` (``"in<k>"`` -> an array over the probe), with the
    graph's scalars ``namespace``, in NumPy; broadcast to the probe's shape."""
    tree = parse(expr) if isinstance(expr, str) else expr
    inputs = {int(name[2:]): value for name, value in arguments.items()}
    with np.errstate(all="ignore"):
        value = tree.evaluate(inputs, namespace)
    return np.broadcast_to(np.asarray(value), PROBE.shape)


def _close(value: np.ndarray, exact: np.ndarray) -> bool:
    return bool(np.all(np.abs(value - exact) <= RELATIVE * np.maximum(np.abs(exact), 1.0)))


def activation(value: np.ndarray) -> str | None:
    """The name of the activation of ``ACTIVATIONS`` that ``value`` (a map's on ``PROBE``) equals, or None."""
    return next((name for name, exact in ACTIVATIONS.items() if _close(value, exact)), None)


def derivative(expr: str | Expression, position: int, namespace: dict) -> tuple[str, float] | None:
    """("relu", scale) or ("gelu", 1.0) when the map ``expr`` of two inputs is ``in<position>``
    times a function of the other that equals, at every point of ``PROBE`` (float64), ReLU's
    derivative times a positive constant (0 at 0) or tanh-GELU's (``RELATIVE``); else None."""
    other = 1 - position
    values = [evaluate(expr, {f"in{position}": np.full_like(PROBE, times), f"in{other}": PROBE}, namespace)
              .astype(np.float64) for times in (1.0, 2.0)]
    once, twice = values
    if not (np.all(np.isfinite(once)) and np.allclose(twice, 2 * once, rtol=1e-12, atol=0.0)):
        return None
    positive = once[PROBE > 0]
    scale = float(positive[0])
    if scale > 0 and np.all(np.abs(positive - scale) <= 1e-12 * scale) and np.all(once[PROBE <= 0] == 0):
        return "relu", scale
    if _close(once, GELU_DERIVATIVE):
        return "gelu", 1.0
    return None
