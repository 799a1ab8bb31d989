"""Whether a plan's program runs forward and backward: checked before an artifact is written.

``check_runnable(plans, graph, operators, interface)`` builds, for every plan (over ``graph`` at
its call dims, as ``TunedLayer.program`` does for a tuned shape), the two programs a layer builds
of it (``LayerProgram``: training, and evaluation with dropout off) on the meta device, and runs
each forward and backward once under ``kernels.launch.dry_launches``.  So every step's launcher is
built and its first call's host side runs as on a GPU: the stack groups and their buffers, the
parameters as the layer holds them (``held_tensors``), every GEMM's operand views and
``gemm_plan`` from the strides of the tensors the store holds, the layout changes, the fused
attention's views, every generated kernel's arguments and grid; no kernel is launched (each
launch's arguments are bound to the kernel's parameters and its grid held to CUDA's limits
instead) and nothing is allocated (meta tensors carry shapes and strides only; their storages all
start at address 0, so where the runtime tells a stack group's one buffer from copies by addresses,
``steps.stacked_view``, the check sees only the members' offsets, which ``Buffers`` lays out as on
a GPU).  The evaluation
program runs with a key-padding mask where the plan's fused attention takes one, as a HF model
calls it.  No GPU is needed and real sizes cost no more than small ones: 0.024 s for BERT-large's
plan (B=8, L=512), 0.035 s for Llama-8B's (B=1, T=4096) on a 2-core CPU, after 0.4 s once per
process (the meta device's first GEMM imports ``torch._dynamo``).

A plan that fails is a bug of the selection (its constraints should have kept it runnable):
``layouts.plan.PlanNotRunnable`` says, in one line, the plan's shape, the step that failed
(``runtime.steps.name_step``) and why; except where a kernel's grid is past CUDA's limits
or an operand past a kernel's int32 offsets
(``kernels.launch.SizeLimitError``, at huge dims): ``PlanPastLimits`` says the dims are too large.
"""
from __future__ import annotations

import torch

from datamove.kernels.launch import SizeLimitError, dry_launches
from datamove.layouts.plan import ATTENTION_FORWARD, Plan, PlanNotRunnable, PlanPastLimits
from datamove.runtime.layer import LayerProgram, TensorInterface, held_tensors, without_dropout
from datamove.runtime.shapes import call_dims, describe
from datamove.runtime.steps import Run


def check_runnable(plans: list[Plan], graph, operators, interface: TensorInterface) -> list[tuple[str, tuple]]:
    """Run every plan's training and evaluation programs dry (module doc); ``plans`` over ``graph``
    at their call dims, ``operators`` the fused graph's.  Returns the launches checked, (kernel name,
    grid) each; raises ``PlanNotRunnable`` at the first failure."""
    dims = call_dims(graph, interface)
    launches = []
    for plan in plans:
        shape = {d: plan.dims[d] for d in dims}
        sized = graph.with_dims({**graph.dim_values, **shape})
        for training in (True, False):
            try:
                launches += _dry_run(plan, sized if training else without_dropout(sized), operators, interface,
                                     masked=not training)
            except Exception as err:  # any failure of a launcher is the plan's: named, in one line
                text = " ".join(str(err).split()) or "(no message)"
                refusal = PlanPastLimits if isinstance(err, SizeLimitError) else PlanNotRunnable
                raise refusal(describe(shape), getattr(err, "plan_step", None),
                              f"{type(err).__name__}: {text}") from err
    return launches


def _dry_run(plan: Plan, graph, operators, interface: TensorInterface, masked: bool) -> list[tuple[str, tuple]]:
    """One forward and backward of ``plan``'s program over ``graph`` on the meta device, its launches
    checked and not made (``dry_launches``); ``masked``: with a key-padding mask where the plan's
    fused attention takes one.  Returns the launches."""
    dtype, meta = plan.dtype.torch, torch.device("meta")
    program = LayerProgram(plan, graph, operators, interface, dtype, meta)
    inputs = [torch.empty(program.torch_shapes[t], dtype=dtype, device=meta) for t in interface.activations]
    held = held_tensors(plan, graph, interface.parameters + interface.constants, dtype, meta)
    inputs += held.values()
    attention = next((s for s in plan.steps if s.kind == ATTENTION_FORWARD), None)
    mask = None
    if masked and attention is not None:
        letters = attention.config.letters
        mask = torch.empty((graph.size(letters["batch"]), graph.size(letters["keys"])), dtype=torch.bool, device=meta)
    run = Run(torch.empty(1, dtype=torch.int64, device=meta), mask)  # the seed in device memory, as a layer draws it
    grads = [torch.empty(program.torch_shapes[t], dtype=dtype, device=meta) for t in interface.outputs]
    with dry_launches() as dry:
        _, kept = program.call_forward(inputs, run)
        program.call_backward(inputs, kept, grads, run)
    return dry.launches
