"""A hand-made plan: every tensor in its spec order, each operator its own kernel (generated ops
at their default configuration, contractions through cuBLAS): the runtime's tests run it
besides the selected plans, as the plan that exercises no attention and no layout change."""
import importlib.util

from datamove.harness.contraction_variants import _stacked
from datamove.layouts.plan import GEMM, GENERATED, Plan, Step
from datamove.layouts.space import default_configuration
from datamove.layouts.step_config import ContractionConfig, GeneratedConfig


def spec_order_plan(fused, spec: str, dtype="float32"):
    graph = fused.graph
    layouts = {t: info.letters for t, info in graph.tensors.items()}
    steps = []
    for op in fused.operators:
        if op.cls != "contraction":
            config = default_configuration(graph, op)
            reads = {t: config.layouts[t] for t in op.inputs}
            writes = {t: config.layouts[t] for t in op.outputs}
            masks = {t: config.layouts[t] for t in op.inputs if graph.tensors[t].role == "dropout"}
            reads = {t: layout for t, layout in reads.items() if t not in masks}
            steps.append(Step(op.name, op.phase, GENERATED, (op.name,), reads, writes,
                              GeneratedConfig(config.knobs, masks), 0.0, "predicted"))
            continue
        einsums = [p for p in op.primitives if p.kind == "einsum"]
        if len(einsums) == 1:
            e = einsums[0]
            einsum = e.expr
            operands = {"a": [e.inputs[0].tensor], "b": [e.inputs[1].tensor], "out": [e.output.tensor]}
        else:
            einsum, _ = _stacked(graph, op, einsums)
            operands = {}
            for key, pick in (("a", lambda e: e.inputs[0].tensor), ("b", lambda e: e.inputs[1].tensor)):
                members = [pick(e) for e in einsums]
                operands[key] = members if len(set(members)) > 1 else members[:1]
            outs = [e.output.tensor for e in einsums]
            operands["out"] = outs if len(operands["a"]) == 1 or len(operands["b"]) == 1 else list(op.outputs)
        reads = {t: layouts[t] for t in op.inputs}
        writes = {t: layouts[t] for t in op.outputs}
        steps.append(Step(op.name, op.phase, GEMM, (op.name,), reads, writes,
                          ContractionConfig(einsum, "cublas", operands), 0.0, "predicted"))
    fwd_written = {t for s in steps if s.phase == "forward" for t in s.writes}
    saved = sorted({t for s in steps if s.phase == "backward" for t in s.reads if t in fwd_written})
    return Plan(spec, dict(graph.dim_values), dtype, "none", "predicted", layouts, steps, saved, 0.0, 0.0)


def spec_module(name: str):
    """The module of ``configs/<name>.py`` (its ``TORCH_ORDER`` and ``WEIGHTS``)."""
    module_spec = importlib.util.spec_from_file_location(f"spec_{name}", f"configs/{name}.py")
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module


def selected_plan(fused, spec: str, dtype="float32"):
    """The cost model's choice (``datamove.candidates.plan_layer``, H100 figures), activations in
    the spec's PyTorch order."""
    from datamove.candidates import plan_layer
    from datamove.layouts.cost_model import device_figures

    order = getattr(spec_module(spec), "TORCH_ORDER", {})
    boundary = {**order, **{f"d_{t}": layout for t, layout in order.items()}}
    return plan_layer(fused, spec, dtype=dtype, figures=device_figures("H100"), boundary=boundary)
