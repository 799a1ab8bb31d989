"""The Llama layer's grouped-query attention plan on a GPU (marker ``gpu``): the cost model's plan
(what the main job selects without measurements: the grouped attention, K/V read over their own
heads in the plan's layouts) exported, loaded with the kernels on the GPU in float32 (TF32 dots),
forward and every gradient against the float64 executor; 8 query heads over 2 K/V heads, head dim
64.  ``check(out, device)`` also runs on the CPU through the interpreter (``tests/test_llama_gqa.py``
covers that path at odd sizes)."""
import warnings

import numpy as np
import pytest
import torch

from datamove.dataflow.executor import execute, known_value

SPEC = "configs/llama.py"
DIMS = dict(B=2, T=128, D=256, H=8, KV=2, E=64, F=512)
TF32_TOLERANCE = 1e-2  # TF32 dots against float64: ~1e-3; a wrong head, layout or group is O(1)


def cost_model_artifact(out, dims: dict, dtype: str = "float32"):
    """The main job's artifact without measurements (``datamove.job``'s path on a machine without a GPU)."""
    from datamove.candidates import plan_layer
    from datamove.dataflow.pipeline import analyse_spec
    from datamove.export import write_artifact
    from datamove.job import boundary_layouts, fused_training
    from datamove.runtime.layer import tensor_interface
    from datamove.layouts.cost_model import device_figures

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        analysis = analyse_spec(SPEC, dims)
    fused = fused_training(analysis)
    module = analysis.spec.function.__globals__
    torch_order, weights = module.get("TORCH_ORDER", {}), module.get("WEIGHTS", {})
    interface = tensor_interface(fused.graph, torch_order, analysis.spec.inputs, module.get("POSITION_TABLES", ()))
    plan = plan_layer(fused, "llama", dtype=dtype, figures=device_figures("H100"), boundary=boundary_layouts(torch_order))
    write_artifact(out, plan, fused.graph, fused.operators, spec_name="llama", spec_digest="test", torch_order=torch_order,
                   weights=weights, versions={}, inputs=interface.activations, positions=interface.positions,
                   device={"name": "cost model: H100", "measured": False})
    return out


def check(out, device: str, tolerance: float) -> dict:
    """The layer of ``out`` on ``device`` in float32 with the kernels, random weights and cos/sin, one
    forward and backward against the float64 executor: {what: relative error}, each asserted below
    ``tolerance``."""
    from datamove.export import load_layer

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        layer = load_layer(out, device=device, dtype=torch.float32, allow_mismatch=True, backend="kernels")
    graph, face = layer.graph, layer.interface
    step = next(s for s in layer.plan.steps if s.kind == "attention_forward")
    assert step.config.groups is not None and step.config.roles["k"] == "k"
    gen = torch.Generator().manual_seed(0)
    rng = np.random.default_rng(1)
    with torch.no_grad():
        for name, p in layer.named_parameters():
            view = layer.spec_view(name)
            view.copy_(torch.randn(view.shape, generator=gen) * (1.0 if view.dim() == 1 else view.shape[0] ** -0.5))
        for name in face.constants:
            view = layer.spec_view(name)
            value = known_value(graph, name) if graph.tensors[name].value else rng.uniform(-1, 1, tuple(view.shape))
            view.copy_(torch.tensor(value))
    (x_name,) = face.activations
    shape = tuple(graph.size(x) for x in face.torch_order[x_name])
    x = torch.randn(shape, generator=gen).to(device).requires_grad_()
    y = layer(x)
    dy = torch.randn(y.shape, generator=gen)
    y.backward(dy.to(device))
    spec = lambda t, v: v.detach().double().cpu().permute([face.torch_order[t].index(l) for l in graph.tensors[t].letters]).numpy()  # noqa: E731
    values = {t: layer.spec_view(t).detach().double().cpu().numpy() for t, _ in layer.named_parameters()}
    values.update({t: layer.spec_view(t).double().cpu().numpy() for t in face.constants})
    values[x_name] = spec(x_name, x)
    (y_name,) = face.outputs
    values[face.grad_outputs[y_name]] = spec(y_name, dy)
    env = execute(graph, values)

    def rel(a, b):
        return float(np.linalg.norm(a - b) / np.linalg.norm(b))

    errors = {"y": rel(spec(y_name, y), env[y_name]), f"d_{x_name}": rel(spec(x_name, x.grad), env[face.input_grads[x_name]])}
    for t, p in layer.named_parameters():
        errors[f"d_{t}"] = rel(layer.spec_view(t, p.grad).double().cpu().numpy(), env[face.input_grads[t]])
    worse = {k: e for k, e in errors.items() if not e < tolerance}
    assert not worse, f"farther than {tolerance} from float64: {worse}"
    return errors


@pytest.mark.gpu
def test_grouped_llama_layer_on_the_gpu(tmp_path):
    print(check(cost_model_artifact(tmp_path / "llama", DIMS), "cuda", TF32_TOLERANCE))
