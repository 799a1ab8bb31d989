"""Device facts, peak-rate table, software versions, and (GPU) the measured ceilings stored once."""
import time

import pytest
import torch

from datamove.harness.bench import measure_ceilings
from datamove.kernels.device import DeviceFacts, NoDevice, peak_tensor_flops, query_device, versions
from datamove.harness.tuning_db import Ceilings
from datamove.harness.tuning_db import TuningDB


@pytest.mark.parametrize("cc, sms, clock_hz, dtype, datasheet", [
    ((9, 0), 132, 1830e6, "bf16", 989.4e12),  # H100 SXM5 whitepaper
    ((8, 0), 108, 1410e6, "bf16", 312e12),  # A100 SXM whitepaper
    ((7, 0), 80, 1530e6, "fp16", 125e12),  # V100 SXM2 whitepaper
    ((8, 9), 142, 2520e6, "bf16", 362e12),  # L40S datasheet
])
def test_peak_table_reproduces_datasheets(cc, sms, clock_hz, dtype, datasheet):
    assert peak_tensor_flops(cc, sms, clock_hz, dtype) == pytest.approx(datasheet, rel=0.015)


def test_peak_unknown_is_none_not_a_guess():
    assert peak_tensor_flops((7, 0), 80, 1530e6, "bf16") is None  # Volta has no bf16 tensor cores
    assert peak_tensor_flops((12, 3), 100, 2e9, "bf16") is None


def test_query_device_matches_torch():
    facts = query_device()
    if not torch.cuda.is_available():
        assert isinstance(facts, NoDevice) and facts.reason  # the runtime's error, no crash
        return
    assert isinstance(facts, DeviceFacts)
    props = torch.cuda.get_device_properties(0)
    assert facts.name == props.name
    assert facts.sm_count == props.multi_processor_count
    assert facts.compute_capability == (props.major, props.minor)
    assert facts.l2_bytes == props.L2_cache_size
    assert facts.memory_bytes == props.total_memory


def test_query_device_out_of_range():
    assert isinstance(query_device(1000), NoDevice)


def test_versions_name_the_software():
    v = versions()
    assert set(v) == {"torch", "triton", "torch_cuda", "cuda_runtime", "cuda_driver"}
    assert v["torch"] == torch.__version__
    if not torch.cuda.is_available():
        assert v["cuda_driver"] == "none"


@pytest.mark.gpu
def test_facts_and_ceilings_plausible_and_stored_once(tmp_path):
    facts = query_device()
    assert facts.compute_capability >= (7, 0) and facts.l2_bytes >= 1 << 20
    assert 0.2e12 < facts.peak_memory_bytes_per_s < 20e12
    with TuningDB(tmp_path / "t.db") as db:
        first = measure_ceilings(db)
        assert isinstance(first, Ceilings) and first.device == facts.name
        # Copy: at most the memory's peak; at least a third of it.
        assert facts.peak_memory_bytes_per_s / 3 < first.copy_bytes_per_s <= facts.peak_memory_bytes_per_s * 1.02
        if facts.peak_bf16_flops is not None:
            assert facts.peak_bf16_flops / 4 < first.gemm_flop_per_s <= facts.peak_bf16_flops * 1.02
        began = time.perf_counter()
        second = measure_ceilings(db)
        assert time.perf_counter() - began < 1.0  # read back, not measured again
        assert second.timestamp == first.timestamp and second.copy_bytes_per_s == first.copy_bytes_per_s
    with TuningDB(tmp_path / "t.db") as db:
        assert db.ceilings(facts.name).gemm_flop_per_s == first.gemm_flop_per_s
