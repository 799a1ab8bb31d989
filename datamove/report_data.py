"""The report's numbers (``datamove.report.ReportData``) from the analysis, the plan and the timings.

Chosen kernels: one row per plan step, its flop the sum of the fused operators it runs
(``dataflow.analysis``), its minimal I/O the distinct elements of the graph tensors it reads and
writes (dropout masks are regenerated, not read).  PyTorch: one row per fused operator, the
unfused operators it replaces run one after another as PyTorch eager does (their I/O summed);
timed by the tuning database's eager baselines (``<op>#eager``; contractions: cuBLAS in spec
order) where measured, else the cost model with one launch per unfused operator.
"""
from __future__ import annotations

import datetime

from datamove.dtypes import Precision, parse
from datamove.report import KernelRow, ReportData
from datamove.harness.contraction_variants import training_gemms
from datamove.kernels.device import versions
from datamove.harness.sweep_variants import op_signature
from datamove.layouts.cost_model import predict_ms
from datamove.layouts.plan import GEMM, GEMM_EPILOGUE, GENERATED, LAYOUT_CHANGE, MEASURED, PREDICTED
from datamove.layouts.step_config import GradientEpilogueConfig


def _kernel_text(step) -> str:
    config = step.config
    if step.kind == GENERATED:
        return "generated Triton, " + ", ".join(f"{k}={v}" for k, v in config.knobs.items() if k not in ("parts",))
    if step.kind in (GEMM, GEMM_EPILOGUE):
        backend = "cuBLAS" if config.backend == "cublas" else "Triton GEMM"
        tail = ""
        if isinstance(config.epilogue, GradientEpilogueConfig):
            tail = " + gradient epilogue" + (" + generated rest" if config.epilogue.rest else "")
        elif config.epilogue is not None:
            tail = " + fused epilogue"
        return f"{backend} {config.einsum}{tail}"
    if step.kind == LAYOUT_CHANGE:
        return f"copy {config.source} -> {config.target}"
    if config.knobs.get("impl") == "cudnn":
        return "cuDNN attention (PyTorch's ATen op)"
    return "fused attention, " + (", ".join(f"{k}={v}" for k, v in config.knobs.items()) or "default knobs")


def _class(step, rows_by_op) -> str:
    if step.kind == LAYOUT_CHANGE:
        return "layout change"
    if step.kind.startswith("attention"):
        return "attention"
    return rows_by_op[step.operators[0]].operator.cls


def report_data(analysis, fused, plan, spec: str, dtype: Precision | str, figures, ceilings, timings,
                measured: bool) -> ReportData:
    """What the report shows of ``plan`` (``dtype``: a ``dtypes.Precision`` in any spelling; the
    report's ``meta`` stores its name)."""
    dtype = parse(dtype)
    graph, itemsize = fused.graph, dtype.itemsize
    rows_by_op = {row.operator.name: row for row in analysis.fused_rows}
    unfused_rows = {row.operator.name: row for row in analysis.training_rows}

    def elements(tensors) -> int:
        return sum(graph.size(graph.tensors[t].letters) for t in tensors
                   if t in graph.tensors and graph.tensors[t].role != "dropout")

    chosen = []
    for step in plan.steps:
        if step.kind == LAYOUT_CHANGE:
            moved = elements([step.config.tensor])
            chosen.append(KernelRow(step.name, "layout change", step.phase, 0, moved, moved, 0, 2 * moved * itemsize,
                                    step.time_ms, step.source, _kernel_text(step)))
            continue
        ins, outs = elements(step.reads), elements(step.writes)
        chosen.append(KernelRow(step.name, _class(step, rows_by_op), step.phase,
                                sum(rows_by_op[n].flop for n in step.operators), ins, outs, (ins + outs) * itemsize,
                                (ins + outs) * itemsize, step.time_ms, step.source, _kernel_text(step)))
    pytorch = []
    gemms = {g.name: g for g in training_gemms(fused)}
    for op in fused.operators:
        members = [unfused_rows[name] for name in fused.merged.get(op.name, (op.name,)) if name in unfused_rows]
        if not members:
            continue
        flop = sum(r.flop for r in members)
        ins, outs = sum(r.input_elements for r in members), sum(r.output_elements for r in members)
        if op.cls == "contraction":
            found = timings.fastest(gemms[op.name].op, gemms[op.name].sizes) if op.name in gemms else None
            family = "gemm"
        else:
            found = timings.fastest(op_signature(spec, op) + "#eager", dict(graph.dim_values))
            family = "generated"
        ms = found if found is not None else sum(
            predict_ms(figures, family, flop=r.flop, bytes_moved=(r.input_elements + r.output_elements) * itemsize,
                       dtype=dtype) for r in members)
        pytorch.append(KernelRow(op.name, op.cls, op.phase, flop, ins, outs, (ins + outs) * itemsize,
                                 (ins + outs) * itemsize, ms, MEASURED if found is not None else PREDICTED,
                                 f"PyTorch eager: {len(members)} operator(s)"))
    limits = ceilings_of(ceilings, figures, dtype, chosen + pytorch)
    meta = {"spec": spec, "dims": dict(graph.dim_values), "dtype": dtype.name, "device": plan.device, "measured": measured,
            "versions": versions(), "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    return ReportData(meta, limits, chosen, pytorch, analysis.movement,
                      {"total_ms": plan.total_ms, "best_sum_ms": plan.best_sum_ms, "timing": plan.timing})


def ceilings_of(ceilings, figures, dtype: Precision | str, rows: list[KernelRow]) -> dict:
    """The report's bandwidth (bytes/s) and compute (flop/s) ceilings and where they come from:
    measured on the device (``harness.bench`` ceilings: a device-to-device copy; the faster of an
    8192^3 GEMM and the fastest measured kernel among ``rows``, so no kernel sits above its roof
    when the clock ran higher than during the ceiling's run), else the cost model's figures."""
    if ceilings is None:
        return {"bandwidth": figures.bandwidth, "flops": figures.peak(dtype), "source": f"cost-model figures of {figures.name}"}
    reached = max((r.flop / (r.time_ms * 1e-3) for r in rows if r.source == MEASURED and r.time_ms > 0), default=0.0)
    return {"bandwidth": ceilings.copy_bytes_per_s, "flops": max(ceilings.gemm_flop_per_s, reached),
            "source": f"measured on {ceilings.device}: device-to-device copy; the faster of an 8192^3 bf16 GEMM "
                      f"and the fastest kernel measured for this report"}
