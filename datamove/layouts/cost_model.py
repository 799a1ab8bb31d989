"""The cost model: a kernel's time predicted from its flop and bytes on a named device.

``time = max(flop / (peak flop/s x efficiency), bytes / (bandwidth x efficiency)) + launches x launch``
(the roofline bound of the paper's Sec. III-C, derated by how close each kernel family gets to it),
plus the bytes of uncoalesced accesses charged at a quarter of the bandwidth.  It ranks candidates
that were not measured and labels their times "predicted"; it is never presented as a measurement.

Device figures were measured on this workplace's machines (a device-to-device copy counting bytes
read and written; an 8192^3 bf16 ``torch.mm`` on random data), not taken from datasheets.
"""
from __future__ import annotations

from dataclasses import dataclass

from datamove.dtypes import BF16, FP16, FP32, Precision, parse

@dataclass(frozen=True)
class DeviceFigures:
    """``bandwidth``: bytes/s of device memory; ``flops``: dense tensor-core flop/s per
    ``dtypes.Precision`` (``peak`` takes any spelling);
    ``launch_s``: a kernel launch's fixed cost on the device (inside a CUDA graph)."""

    name: str
    bandwidth: float
    flops: dict
    launch_s: float = 2.5e-6

    def peak(self, dtype: Precision | str) -> float:
        return self.flops.get(parse(dtype), self.flops[BF16])


DEVICES = {
    "H100": DeviceFigures("NVIDIA H100 80GB HBM3", 3.0e12, {BF16: 7.9e14, FP16: 7.9e14, FP32: 4.0e14}),
    "H200": DeviceFigures("NVIDIA H200", 4.3e12, {BF16: 7.9e14, FP16: 7.9e14, FP32: 4.0e14}),
}

# How close each kernel family comes to the roofline (fractions of peak flop/s and bandwidth),
# from this project's measurements (benchmarks/results: GEMMs ~70% of the measured peak at
# BERT-large sizes, generated element-wise kernels ~75% of the copy bandwidth, the fused attention
# ~45% of peak flop/s).
EFFICIENCY = {"gemm": 0.7, "generated": 0.75, "attention": 0.45, "copy": 0.8}


def device_figures(name: str) -> DeviceFigures:
    """Figures of a named device (``DEVICES``' keys, or a CUDA device name containing one)."""
    for key, figures in DEVICES.items():
        if key.lower() == name.lower() or key.lower() in name.lower():
            return figures
    raise KeyError(f"no cost-model figures for device {name!r}; known: {', '.join(DEVICES)}")


def predict_ms(figures: DeviceFigures, family: str, *, flop: float, bytes_moved: float, dtype: Precision | str = BF16,
               uncoalesced_bytes: float = 0.0, launches: int = 1) -> float:
    """Predicted time in milliseconds of one kernel of ``family`` (``EFFICIENCY``' keys)."""
    efficiency = EFFICIENCY[family]
    compute = flop / (figures.peak(dtype) * efficiency)
    memory = (bytes_moved + 3.0 * uncoalesced_bytes) / (figures.bandwidth * efficiency)
    return (max(compute, memory) + launches * figures.launch_s) * 1e3
