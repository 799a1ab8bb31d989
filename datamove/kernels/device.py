"""Device facts through cuda-python: what the GPU is and its theoretical peaks.

``query_device()`` reads the CUDA device attributes with ``cuda.bindings.runtime`` and derives the
theoretical peaks from them; with no driver or no GPU it returns a ``NoDevice`` that says why (the
runtime answers with an error code, nothing crashes).  The measured ceilings (a large copy and a
large GEMM) are taken by ``harness.bench.measure_ceilings`` and kept in the tuning DB.
``versions()`` names the software a measurement was taken with (part of every tuning-DB key);
``source_id(*files)`` names the version of a kernel's own source (the knobs of its timings carry it).
"""
from __future__ import annotations

import functools
import hashlib
from dataclasses import asdict, dataclass
from pathlib import Path

from cuda.bindings import runtime as cudart

# Dense (no sparsity) tensor-core rate, floating-point operations (one FMA = 2) per clock per SM,
# by compute capability; fp32 accumulation.  Derived from NVIDIA's whitepaper peaks and clocks:
#   cc 7.0  V100 SXM2: 125 TFLOP/s fp16 = 80 SMs x 1530 MHz x 1024      (Volta whitepaper; no bf16)
#   cc 7.5  T4:         65 TFLOP/s fp16 = 40 SMs x 1590 MHz x 1024      (Turing whitepaper; no bf16)
#   cc 8.0  A100 SXM:  312 TFLOP/s bf16/fp16 = 108 SMs x 1410 MHz x 2048 (A100 whitepaper)
#   cc 8.6  RTX A6000: 154.8 TFLOP/s fp16 = 84 SMs x 1800 MHz x 1024    (GA102 whitepaper; GeForce
#           parts run fp32-accumulating tensor ops at half this rate)
#   cc 8.9  L40S:      362 TFLOP/s bf16/fp16 = 142 SMs x 2520 MHz x 1024 (Ada whitepaper / L40S datasheet)
#   cc 9.0  H100 SXM5: 989.4 TFLOP/s bf16/fp16 = 132 SMs x 1830 MHz x 4096 (H100 whitepaper)
# Other capabilities are unknown here and give no peak (None) rather than a guess.
TENSOR_FLOP_PER_CLOCK_PER_SM: dict[tuple[int, int], dict[str, int]] = {
    (7, 0): {"fp16": 1024},
    (7, 5): {"fp16": 1024},
    (8, 0): {"fp16": 2048, "bf16": 2048},
    (8, 6): {"fp16": 1024, "bf16": 1024},
    (8, 9): {"fp16": 1024, "bf16": 1024},
    (9, 0): {"fp16": 4096, "bf16": 4096},
}



@dataclass(frozen=True)
class DeviceFacts:
    """What the CUDA runtime reports about one GPU, and the peaks derived from it.

    Clocks in Hz, sizes in bytes, rates in bytes/s and flop/s.  ``peak_*`` use the maximum SM
    clock the device reports (``cudaDevAttrClockRate``), so they are upper bounds: an H100 SXM
    reports 1980 MHz, above the 1830 MHz of its 989 TFLOP/s datasheet figure.
    """

    index: int
    name: str
    compute_capability: tuple[int, int]
    sm_count: int
    l2_bytes: int
    memory_bytes: int
    shared_memory_per_block_optin: int
    memory_clock_hz: int
    memory_bus_bits: int
    sm_clock_hz: int
    peak_memory_bytes_per_s: float  # 2 (double data rate) x memory clock x bus width / 8
    peak_fp16_flops: float | None  # dense tensor-core fp16, None where the table has no entry
    peak_bf16_flops: float | None  # dense tensor-core bf16, None where unsupported or unknown

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class NoDevice:
    """No usable CUDA GPU; ``reason`` is the runtime's own error text."""

    reason: str


def _check(result, what: str):
    """Unpack a cuda-python ``(err, value...)`` tuple; raise with the runtime's text on error."""
    err, *values = result
    if err != cudart.cudaError_t.cudaSuccess:
        raise RuntimeError(f"{what}: {_error_text(err)}")
    return values[0] if len(values) == 1 else values


def _error_text(err) -> str:
    _, text = cudart.cudaGetErrorString(err)
    return f"{err.name}: {text.decode()}"


def peak_tensor_flops(compute_capability: tuple[int, int], sm_count: int, sm_clock_hz: float, dtype: str) -> float | None:
    """Dense tensor-core flop/s = SMs x clock x per-SM per-clock rate; None where the table has none."""
    rate = TENSOR_FLOP_PER_CLOCK_PER_SM.get(tuple(compute_capability), {}).get(dtype)
    return None if rate is None else float(sm_count) * sm_clock_hz * rate


def device_count() -> int:
    """CUDA devices this process sees (0 without a driver or a GPU)."""
    err, count = cudart.cudaGetDeviceCount()
    return count if err == cudart.cudaError_t.cudaSuccess else 0


def query_device(index: int = 0) -> DeviceFacts | NoDevice:
    """Facts about CUDA device ``index``, or ``NoDevice`` with the runtime's reason."""
    err, count = cudart.cudaGetDeviceCount()
    if err != cudart.cudaError_t.cudaSuccess:
        return NoDevice(_error_text(err))
    if index >= count:
        return NoDevice(f"device {index} requested, {count} CUDA device(s) present")

    def attr(name: str) -> int:
        return _check(cudart.cudaDeviceGetAttribute(getattr(cudart.cudaDeviceAttr, name), index), name)

    props = _check(cudart.cudaGetDeviceProperties(index), "cudaGetDeviceProperties")
    name = props.name.split(b"\0", 1)[0].decode() if isinstance(props.name, bytes) else str(props.name)
    cc = (attr("cudaDevAttrComputeCapabilityMajor"), attr("cudaDevAttrComputeCapabilityMinor"))
    sm_count = attr("cudaDevAttrMultiProcessorCount")
    memory_clock_hz = attr("cudaDevAttrMemoryClockRate") * 1000  # attribute is in kHz
    bus_bits = attr("cudaDevAttrGlobalMemoryBusWidth")
    sm_clock_hz = attr("cudaDevAttrClockRate") * 1000  # kHz, the maximum SM clock
    return DeviceFacts(
        index=index,
        name=name,
        compute_capability=cc,
        sm_count=sm_count,
        l2_bytes=attr("cudaDevAttrL2CacheSize"),
        memory_bytes=int(props.totalGlobalMem),
        shared_memory_per_block_optin=attr("cudaDevAttrMaxSharedMemoryPerBlockOptin"),
        memory_clock_hz=memory_clock_hz,
        memory_bus_bits=bus_bits,
        sm_clock_hz=sm_clock_hz,
        peak_memory_bytes_per_s=2.0 * memory_clock_hz * bus_bits / 8,
        peak_fp16_flops=peak_tensor_flops(cc, sm_count, sm_clock_hz, "fp16"),
        peak_bf16_flops=peak_tensor_flops(cc, sm_count, sm_clock_hz, "bf16"),
    )


def _cuda_version_text(version: int) -> str:
    return "none" if version <= 0 else f"{version // 1000}.{version % 1000 // 10}"


@functools.cache
def versions() -> dict[str, str]:
    """Software versions a measurement depends on: torch, triton, CUDA (torch's build, runtime, driver)."""
    import torch
    import triton

    _, runtime_version = cudart.cudaRuntimeGetVersion()
    _, driver_version = cudart.cudaDriverGetVersion()
    return {
        "torch": torch.__version__,
        "triton": triton.__version__,
        "torch_cuda": str(torch.version.cuda),
        "cuda_runtime": _cuda_version_text(runtime_version or 0),
        "cuda_driver": _cuda_version_text(driver_version or 0),
    }


def source_id(*files: str) -> str:
    """A 12-digit hash of ``files``' bytes (a kernel's module and the Triton functions it calls): a
    timing holds for the source that was timed, so the tuning database's knobs carry it and the
    selection leaves out timings of another version (``datamove.candidates.Timings``)."""
    digest = hashlib.sha256()
    for file in files:
        digest.update(Path(file).read_bytes())
    return digest.hexdigest()[:12]
