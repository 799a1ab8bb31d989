"""The end-to-end benchmarks' tables (``benchmarks/layer.py``, from synthetic profiler events;
``benchmarks/model.py``), and ``benchmarks/model.py``'s Llama models on the CPU at the spec's small dims."""
import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # benchmarks/model.py imports benchmarks.layer


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"{name}_benchmark", ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


layer_benchmark, model_benchmark = _load("layer"), _load("model")


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


def test_model_tables_of_the_measured_bert_runs_are_as_committed():
    for stem in ("model", "model_h200"):
        report = json.loads((ROOT / "benchmarks" / "results" / f"{stem}.json").read_text())
        expected = (ROOT / "benchmarks" / "results" / f"{stem}.md").read_text()
        assert model_benchmark.markdown({**report, "spec": "bert"}) == expected


def test_model_table_of_a_llama_case():
    row = {"wall_ms": 120.0, "kernel_ms": 100.0, "peak_mib": 30000.0, "graph_held_mib": 9000.0}
    dims = {"B": 4, "D": 2048, "E": 64, "F": 8192, "H": 32, "KV": 8, "T": 2048}
    report = {"spec": "llama", "device": "GPU", "date": "today", "versions": {"torch": "x"},
              "cases": [{"dims": dims, "dtype": "bfloat16", "layers": 16, "plan_device": {"name": "GPU"}, "date": "now",
                         "rows": {"datamove": row, "liger+compile": {**row, "wall_ms": 150.0, "graph_held_mib": 0.0},
                                  "liger": {"error": "ImportError: no liger_kernel"}}}]}
    lines = model_benchmark.markdown(report).splitlines()
    assert lines[0] == "# A HF LlamaModel's training step (GPU, today)"
    assert "## B=4 T=2048 D=2048 H=32 KV=8 E=64 F=8192 bfloat16, 16 layers (plan timed on GPU; measured now)" in lines
    assert "| liger+compile | 150.00 | 100.00 | 1.50 | 30000 | 0 | 1.25 |" in lines
    assert "| liger | error: ImportError: no liger_kernel | | | | | |" in lines


def test_llama_models_start_alike_and_train_on_cpu(llama_artifact):
    """The replaced model (the torch backend here) and HF's, same initial weights and padded batches:
    the same losses over three AdamW steps (bf16 against the layers' float32)."""
    pytest.importorskip("transformers")
    manifest = model_benchmark.read_manifest(llama_artifact)
    initial_weights, losses = {}, {}
    for name in ("datamove", "hf-sdpa"):
        model, vocab = model_benchmark.build(name, llama_artifact, manifest, 2, torch.bfloat16, "cpu", initial_weights)
        replaced = [m for m in model.modules() if isinstance(m, model_benchmark.BertLayerReplacement)]
        assert len(replaced) == (2 if name == "datamove" else 0)
        batches = model_benchmark.batches(manifest["dims"], vocab, "cpu")
        assert not all(bool(mask.all()) for _, mask, _ in batches)  # some sequences are padded
        trainer = model_benchmark.Trainer(model, batches, model.config.hidden_size, torch.bfloat16, "cpu")
        losses[name] = torch.stack([trainer.step() for _ in range(3)])
    assert torch.allclose(losses["datamove"], losses["hf-sdpa"], rtol=2e-3)


def test_gpt2_models_start_alike_and_train_on_cpu(gpt2_artifact):
    """GPT-2's case: the replaced model and HF's, same initial weights and padded batches, dropout off
    (eval: masks are not drawn alike): the same losses over three AdamW steps."""
    pytest.importorskip("transformers")
    manifest = model_benchmark.read_manifest(gpt2_artifact)
    initial_weights, losses = {}, {}
    for name in ("datamove", "hf-sdpa"):
        model, vocab = model_benchmark.build(name, gpt2_artifact, manifest, 2, torch.bfloat16, "cpu", initial_weights)
        model.eval()
        assert len([m for m in model.modules() if isinstance(m, model_benchmark.BertLayerReplacement)]) == \
            (2 if name == "datamove" else 0)
        batches = model_benchmark.batches(manifest["dims"], vocab, "cpu")
        trainer = model_benchmark.Trainer(model, batches, model.config.hidden_size, torch.bfloat16, "cpu")
        losses[name] = torch.stack([trainer.step() for _ in range(3)])
    assert torch.allclose(losses["datamove"], losses["hf-sdpa"], rtol=2e-3)


distributed_benchmark = _load("distributed")


def _run(world: int, rows: dict, device: str = "GPU") -> dict:
    case = {"artifact": "out/bert", "spec": "bert", "dims": {"B": 8, "L": 512}, "dtype": "bfloat16", "layers": 24,
            "plan_device": {"name": "GPU"}}
    return {"world_size": world, "date": "2026-11-27T00:00:00+00:00", "steps": 10, "case": case,
            "versions": {"torch": "x"}, "device": device, "rows": rows}


def _row(wall_ms: float, losses: list, date: str = "2026-11-27T00:00:00+00:00", **extra) -> dict:
    return {"wall_ms": wall_ms, "tokens_per_s_per_gpu": 4096 / wall_ms * 1e3, "peak_mib": 7000.0, "warmup_s": 3.0,
            "losses": losses, "date": date, **extra}


def test_distributed_rows_merge_per_gpu_count_and_compare_losses_with_hf():
    bench = distributed_benchmark
    first = bench.merged({}, _run(2, {"ddp": {"hf-sdpa": _row(80.0, [2.0, 1.9]),
                                              "datamove": _row(30.0, [2.0, 1.8])}}))
    failed = {"error": "OutOfMemoryError: CUDA out of memory", "date": "2026-11-28T00:00:00+00:00"}
    later = _run(2, {"ddp": {"datamove": _row(25.0, [2.0, 1.85], "2026-11-28T00:00:00+00:00")},
                     "fsdp2": {"datamove": failed}})
    report = bench.merged(bench.merged(first, _run(1, {"ddp": {"datamove": _row(24.0, [2.0, 1.8])}})), later)
    rows = report["runs"]["2"]["rows"]
    assert list(report["runs"]) == ["1", "2"]
    assert rows["ddp"]["hf-sdpa"]["wall_ms"] == 80.0 and rows["ddp"]["datamove"]["wall_ms"] == 25.0  # kept, replaced
    assert rows["ddp"]["datamove"]["loss_vs_hf"]["per_step"] == [0.0, pytest.approx(0.05)]
    assert rows["fsdp2"]["datamove"] == failed
    other = bench.merged(report, _run(2, {"ddp": {"datamove": _row(26.0, [2.0, 1.8])}}, device="another GPU"))
    assert list(other["runs"]["2"]["rows"]["ddp"]) == ["datamove"]  # another device: the section is replaced


def test_distributed_tables_show_errors_replicas_and_scaling():
    bench = distributed_benchmark
    replicas = {"parameters": 391, "differing": 0, "max_abs_diff": 0.0}
    report = bench.merged({}, _run(1, {"ddp": {"datamove": _row(24.0, [2.0, 1.8], replicas=replicas)}}))
    report = bench.merged(report, _run(2, {
        "ddp": {"hf-sdpa": _row(80.0, [2.0, 1.9]),
                "datamove": _row(32.0, [2.0, 1.8], replicas={**replicas, "differing": 2, "max_abs_diff": 0.004})},
        "fsdp2": {"datamove": {"error": "RuntimeError: no", "date": "2026-11-28T00:00:00+00:00"},
                  "compile-default": _row(64.0, [2.0, 1.9], dynamo={"graphs": 3, "graph_breaks": 4})}}))
    lines = bench.markdown(report).splitlines()
    assert "## 2 x GPU (measured 2026-11-27 to 2026-11-28)" in lines
    assert "| ddp | datamove | 24.00 | 170,667 | 7000 | 3.0 | 1.8000 |  | all equal (391 tensors) |  |" in lines
    assert "| ddp | datamove | 32.00 | 128,000 | 7000 | 3.0 | 1.8000 | 1.00e-01 | 2 of 391 differ (max 0.004) |  |" \
        in lines
    assert "| fsdp2 | datamove | RuntimeError: no | | | | | | | |" in lines
    assert "| fsdp2 | compile-default | 64.00 | 64,000 | 7000 | 3.0 | 1.9000 |  |  | dynamo: 3 graphs, 4 breaks |" in lines
    assert "| ddp | datamove | 170,667 | 128,000 |" in lines  # tokens/s per GPU at 1 and 2 GPUs
    assert "| ddp | hf-sdpa |  | 51,200 |" in lines


def test_the_tuning_cost_table_names_each_runs_wall_time_stop_and_the_plans_gap():
    tuning_cost = _load("tuning_cost")
    stage = {"stage": "GEMMs: cuBLASLt's other algorithms", "counts": {"ok": 40, "skipped": 3, "too slow": 1},
             "pruned": 120, "pruned_why": "why", "left": 0, "wall_s": 12.5}
    finished = {"wall_s": 281.0, "rc": 0, "tuning": {"stopped": None, "stages": [stage]}, "plan_ms": 0.71243}
    case = {"name": "bert", "dims": "B=8,L=512", "cold": finished, "warm": {"wall_s": 14.2, "rc": 0, "tuning": None},
            "exhaustive": {"wall_s": 1900.0, "rc": 0}, "kernel_ms": {"default": 0.7124, "exhaustive": 0.7098, "gap_percent": 0.37}}
    stopped = {"wall_s": 610.0, "rc": 0, "tuning": {"stopped": "stopped: time budget of 600 s used; 7 variant(s) ...",
                                                    "stages": []}}
    failed = {"wall_s": 3.0, "rc": 2, "error": "optimize-layer: error: no"}
    report = {"device": "GPU", "date": "today", "versions": {"torch": "x"},
              "cases": [case, {"name": "llama", "dims": "B=4", "cold": stopped, "warm": finished, "exhaustive": failed}]}
    lines = tuning_cost.markdown(report).splitlines()
    assert "| bert B=8,L=512 | 281.0 | finished | 0.7124 | 14.2 | 1900.0 | 0.7124 | 0.7098 | +0.37% |" in lines
    assert ("| llama B=4 | 610.0 | stopped: time budget of 600 s used; 7 variant(s) ... |  | 281.0 | "
            "3.0 (failed (exit 2: optimize-layer: error: no)) |  |  |  |") in lines
    partial = tuning_cost.markdown({**report, "cases": [{"name": "gpt2", "dims": "B=4", "cold": finished}]}).splitlines()
    assert "| gpt2 B=4 | 281.0 | finished | 0.7124 | not run | not run |  |  |  |" in partial
    assert "| GEMMs: cuBLASLt's other algorithms | 40 | 1 | 3 | 120 | 0 | 12.5 |" in lines


def test_the_tuning_cost_steps_run_once_each_and_the_exhaustive_one_until_it_finishes(tmp_path, monkeypatch):
    """``benchmarks/tuning_cost.py`` split over device calls: each step's record kept in the work
    folder, a step done not run again, the exhaustive run again while its budget stops it, the
    plans compared only once it finished, a cold run refused over a database."""
    tuning_cost = _load("tuning_cost")
    runs = []

    def optimize(spec, dims, db, out, budget_s, exhaustive=False):
        runs.append(("exhaustive" if exhaustive else "default", db.name))
        db.write_text("records")
        stopped = exhaustive and sum(kind == "exhaustive" for kind, _ in runs) == 1  # its first run stopped
        return {"wall_s": 1.0, "rc": 0, "tuning": {"stopped": "stopped: budget" if stopped else None, "stages": []}}
    monkeypatch.setattr(tuning_cost, "optimize", optimize)
    monkeypatch.setattr(tuning_cost, "compare_plans", lambda default, exhaustive: {"default": 1.0, "exhaustive": 1.0,
                                                                                 "gap_percent": 0.0})
    case = lambda steps: tuning_cost.run_case(tmp_path, "bert", "configs/bert.py", "B=8,L=512", None, 60.0, steps)  # noqa: E731
    with pytest.raises(SystemExit, match="needs the cold run first"):
        case(["warm"])
    assert set(case(["cold"])) == {"name", "spec", "dims", "cold"}
    done = case(list(tuning_cost.STEPS))  # warm, the exhaustive run stopped, no comparison
    assert "kernel_ms" not in done and done["exhaustive"]["tuning"]["stopped"]
    done = case(list(tuning_cost.STEPS))  # the exhaustive run goes on, then the comparison
    assert done["kernel_ms"]["gap_percent"] == 0.0 and not done["exhaustive"]["tuning"]["stopped"]
    case(list(tuning_cost.STEPS))  # all done: nothing runs
    assert runs == [("default", "tuning.db"), ("default", "tuning.db"), ("exhaustive", "exhaustive.db"),
                    ("exhaustive", "exhaustive.db")]
    (tmp_path / "bert" / "cold.json").unlink()
    with pytest.raises(SystemExit, match="needs an empty database"):
        case(["cold"])


def test_the_tuning_scaling_table_gives_variants_per_second_per_gpu_count_and_stage(tmp_path, monkeypatch):
    """``benchmarks/tuning_scaling.py``: variants measured (every outcome but read back) over the
    seconds of the stages that measured, the speed-up over one GPU, plans compared only where every
    run finished, and a count done not run again."""
    scaling = _load("tuning_scaling")

    def run(gpus, seconds, stopped=None):
        stages = [{"stage": "fused operators", "counts": {"ok": 90, "too slow": 10}, "wall_s": seconds[0],
                   "startup_s": 5.0, "measure_workers": gpus, "measure_busy_s": 20.0 * gpus, "compile_workers": 8,
                   "compile_busy_s": 20.0 * 8, "measure_phases_s": {"build": 5.0, "check": 10.0, "time": 15.0}},
                  {"stage": "attention", "counts": {"ok": 8, "failed": 2}, "wall_s": seconds[1]},
                  {"stage": "layout changes", "counts": {"skipped": 4}, "wall_s": 0.5}]
        tuning = {"stopped": stopped, "stages": stages}
        return {"gpus": gpus, "wall_s": 100.0, "rc": 0, "tuning": tuning, "plan_ms": 0.75,
                "throughput": scaling.throughput(tuning)}

    one, two = run(1, (50.0, 5.0)), run(2, (25.0, 5.0))
    assert one["throughput"]["measured"] == 110 and one["throughput"]["measuring_s"] == 55.0
    assert one["throughput"]["per_s"] == 2.0 and two["throughput"]["per_s"] == 3.67
    report = {"device": "GPU", "date": "today", "versions": {"torch": "x"}, "spec": "configs/bert.py",
              "dims": "B=8,L=512", "budget_s": None, "runs": [one, two]}
    lines = scaling.markdown(report).splitlines()
    assert "| 1 | 100.0 | finished | 110 | 55.0 | 2.0 | 1.00x | 0.75 |" in lines
    assert "| 2 | 100.0 | finished | 110 | 30.0 | 3.67 | 1.83x | 0.75 |" in lines
    assert "| fused operators | 100 / 50.0 (2.0) | 100 / 25.0 (4.0) |" in lines
    assert "| layout changes | 0 / 0.5 | 0 / 0.5 |" in lines
    assert "| fused operators | 5.0 s / 40% / 40% | 5.0 s / 80% / 80% |" in lines
    assert "| fused operators | 50.0 / 100.0 / 150.0 | 50.0 / 100.0 / 150.0 |" in lines  # ms a variant, by phase
    cut = scaling.markdown({**report, "runs": [one, run(2, (25.0, 5.0), stopped="stopped: budget")]}).splitlines()
    assert "| 2 | 100.0 | stopped: budget | 110 | 30.0 | 3.67 | 1.83x |  |" in cut

    calls = []
    for variable in scaling.COLD_CACHES:  # restored after the test: run_count sets them for its job
        monkeypatch.setenv(variable, "unset")
    monkeypatch.setattr(scaling, "optimize", lambda spec, dims, db, out, budget_s, gpus: calls.append(gpus) or
                        {"wall_s": 1.0, "rc": 0, "tuning": one["tuning"], "plan_ms": 0.75})
    assert scaling.run_count(tmp_path, "configs/bert.py", "B=8,L=512", 2, 90.0)["throughput"]["per_s"] == 2.0
    assert scaling.run_count(tmp_path, "configs/bert.py", "B=8,L=512", 2, 90.0)["gpus"] == 2 and calls == [2]
    monkeypatch.setattr(scaling, "optimize", lambda spec, dims, db, out, budget_s, gpus: calls.append(gpus) or
                        {"wall_s": 0.1, "rc": 1, "tuning": None, "error": "ModuleNotFoundError"})
    for _ in range(2):  # a failed run is not kept
        assert scaling.run_count(tmp_path, "configs/bert.py", "B=8,L=512", 4, 90.0)["rc"] == 1
    assert calls == [2, 4, 4]


@pytest.mark.parametrize("script, argv", [
    ("attention_gqa.py", []), ("attention_breakdown.py", []), ("dropout_grouped.py", []),
    ("layer.py", ["--artifact", "x"]), ("model.py", ["--artifact", "x"]), ("host_time.py", ["--artifact", "x"]),
    ("shapes.py", ["--tuned", "x", "--at", "y"]), ("tuning_cost.py", ["--case", "bert", "configs/bert.py", "B=8"]),
])
def test_a_gpu_benchmark_without_a_gpu_says_so_in_one_line(script, argv, monkeypatch, capsys):
    """Run where no CUDA GPU is: exit status 2 and one line, before anything is read or made
    (``attention_gqa.py`` failed inside torch asking for a CUDA generator)."""
    import runpy

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(sys, "argv", [script, *argv])
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))  # as run: its folder first (shapes.py imports layer)
    with pytest.raises(SystemExit) as stopped:
        runpy.run_path(str(ROOT / "benchmarks" / script), run_name="__main__")
    assert stopped.value.code == 2
    assert capsys.readouterr().err.strip() == f"benchmarks/{script} times GPU kernels and needs a CUDA GPU: nothing measured"
