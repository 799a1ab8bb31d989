"""The acceptance rule for low-precision results (after lightning-thunder's ``assert_closer``).

A bf16/fp16 result passes when its error against a float64 reference is no larger than the error
of PyTorch's own result at that precision, times ``factor``, plus ``margin``.  Errors are
relative Frobenius norms, ``||x - ref|| / ||ref||``.  NaN or Inf never passes.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


def relative_error(result: torch.Tensor, reference: torch.Tensor) -> float:
    """``||result - reference|| / ||reference||`` computed in float64 on the CPU."""
    result = result.detach().to("cpu", torch.float64)
    reference = reference.detach().to("cpu", torch.float64)
    if result.shape != reference.shape:
        raise ValueError(f"shape {tuple(result.shape)} != reference shape {tuple(reference.shape)}")
    if not torch.isfinite(result).all():
        return float("inf")
    return float(torch.linalg.vector_norm(result - reference) / torch.linalg.vector_norm(reference).clamp_min(1e-300))


@dataclass(frozen=True)
class Closeness:
    """Error of a result and of PyTorch's baseline, both against the float64 reference."""

    error: float
    baseline_error: float
    passed: bool

    def __str__(self) -> str:
        verdict = "ok" if self.passed else "FAILED"
        return f"rel.err {self.error:.3e} vs PyTorch {self.baseline_error:.3e}: {verdict}"


def closeness(result, baseline, reference, factor: float = 1.5, margin: float = 1e-4) -> Closeness:
    """Judge ``result`` against ``reference`` (float64), allowing what ``baseline`` (PyTorch, same dtype) errs."""
    error = relative_error(result, reference)
    baseline_error = relative_error(baseline, reference)
    return Closeness(error, baseline_error, error <= factor * baseline_error + margin)


def assert_closer(result, baseline, reference, factor: float = 1.5, margin: float = 1e-4, what: str = "result") -> None:
    verdict = closeness(result, baseline, reference, factor, margin)
    assert verdict.passed, f"{what}: {verdict}"
