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


def test_breakdown_shows_bandwidth_of_generated_steps_against_a_same_size_copy():
    breakdown = [{"step": "x1", "phase": "forward", "kind": "generated", "ms": 0.02, "plan_ms": 0.021,
                  "plan_source": "measured", "bytes": 33_554_432, "copy_ms": 0.015},
                 {"step": "w1_x1", "phase": "forward", "kind": "gemm", "ms": 0.05, "plan_ms": 0.05,
                  "plan_source": "measured", "bytes": 50_331_648}]
    report = {"device": "GPU", "date": "today", "versions": {"torch": "x"},
              "cases": [{"dims": {"B": 8, "L": 512}, "dtype": "bfloat16", "plan_device": {"name": "GPU"},
                         "rows": {}, "breakdown": breakdown}]}
    lines = layer_benchmark.markdown(report).splitlines()
    assert "| x1 | forward | generated | 0.0200 | 0.0210 (measured) | 33.6 | 1678 | 75 |" in lines
    assert "| w1_x1 | forward | gemm | 0.0500 | 0.0500 (measured) | | | |" in lines
    assert "| total | | | 0.0700 | | | | |" in lines
