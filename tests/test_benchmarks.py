"""The end-to-end benchmark's tables (``benchmarks/layer.py``), from synthetic profiler events."""
import importlib.util
from pathlib import Path

SPEC = importlib.util.spec_from_file_location("layer_benchmark", Path(__file__).parents[1] / "benchmarks" / "layer.py")
layer_benchmark = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(layer_benchmark)


def test_kernels_are_grouped_per_call_slowest_first():
    events = [("gemm", 30.0), ("fill", 2.0), ("gemm", 34.0), ("fill", 2.5), ("attn|bwd", 50.0), ("fill", 1.5)]
    rows = layer_benchmark.per_kernel(events, calls=2)
    assert rows == [{"name": "gemm", "us": 32.0, "count": 1.0}, {"name": "attn|bwd", "us": 25.0, "count": 0.5},
                    {"name": "fill", "us": 3.0, "count": 1.5}]


def test_kernel_table_sets_the_layers_side_by_side():
    ours = layer_benchmark.per_kernel([("d_b1_kernel", 34.4), ("nvjet_gemm", 138.6)], 1)
    theirs = layer_benchmark.per_kernel([("triton_poi_fused_relu", 28.9)], 1)
    case = {"rows": {"datamove|fwd+bwd": {"kernels": ours}, "compile-default|fwd+bwd": {"kernels": theirs},
                     "compile-max-autotune|fwd+bwd": {"error": "RuntimeError: no"}, "datamove|forward": {}}}
    lines = layer_benchmark.kernel_lines(case)
    assert lines[2] == "| datamove | us | n | compile-default | us | n |"
    assert lines[4] == "| nvjet_gemm | 138.6 | 1 | triton_poi_fused_relu | 28.9 | 1 |"
    assert lines[5] == "| d_b1_kernel | 34.4 | 1 |  |  |  |"
    assert layer_benchmark.kernel_lines({"rows": {}}) == []
