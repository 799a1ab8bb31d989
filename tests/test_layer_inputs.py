"""The exported layer takes its data inputs as arguments (``layer(*inputs)`` or by name) and holds
its weights: specs from ``tests/specs_plain/`` go through the main job (cost model, CPU), are
loaded in float32 (the torch backend, and the kernels through the Triton interpreter) and called with random inputs; the output and
the gradient of every input and every parameter are compared with the spec written in torch
(``test_plain_specs.CORPUS``) in float64 on the same values.  No spec here has dropout.
"""
import textwrap
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from datamove.cli import main
from datamove.dataflow.layer_inputs import data_inputs
from datamove.dataflow.snapshot import stored_fused
from datamove.export import load_layer, read_manifest
from test_plain_specs import CORPUS

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="float32 through the Triton interpreter (CPU)")

SPECS = Path(__file__).parent / "specs_plain"
FLOAT32_TOLERANCE = 2e-5  # interpreter float32 vs float64, relative to the reference's norm


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """``exported(spec_path, dims)``: the artifact the main job writes for it (each once)."""
    cache = {}

    def get(path: Path, dims: str = "") -> Path:
        if (path, dims) not in cache:
            out = tmp_path_factory.mktemp(path.stem)
            assert main([str(path), "--out", str(out)] + (["--dims", dims] if dims else [])) == 0
            cache[path, dims] = out
        return cache[path, dims]
    return get


def load(path, backend="torch"):
    """The layer in float32 on CPU (the job tuned it for bf16 under the cost model: run untuned):
    its computation in PyTorch operations, or (``backend="kernels"``) its kernels through the Triton interpreter."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return load_layer(path, device="cpu", dtype=torch.float32, allow_mismatch=True, backend=backend)


def error(result: torch.Tensor, reference: torch.Tensor) -> float:
    result, reference = result.detach().double(), reference.detach().double()
    return float(torch.linalg.norm(result - reference) / torch.linalg.norm(reference))


def random_values(layer, names, seed: int) -> dict[str, torch.Tensor]:
    """Random float32 tensors for ``names`` in their spec letter order (no TORCH_ORDER in these specs)."""
    gen = torch.Generator().manual_seed(seed)
    return {t: torch.randn(layer.program(True).shape(t), generator=gen) for t in names}


def check_against_torch(layer, reference, inputs: dict[str, torch.Tensor], call) -> None:
    """``call(layer, inputs)``'s output and the gradients of the inputs and parameters vs ``reference``
    (a ``CORPUS`` layer) in float64 on the same values."""
    params = random_values(layer, layer.interface.parameters, 1)
    layer.zero_grad(set_to_none=True)
    with torch.no_grad():
        for t, value in params.items():
            layer.spec_view(t).copy_(value)
    given = {t: x.clone().requires_grad_() for t, x in inputs.items()}
    y = call(layer, given)
    dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(2))
    y.backward(dy)
    leaves = {t: x.double().requires_grad_() for t, x in {**inputs, **params}.items()}
    expected = reference(leaves, {})
    expected.backward(dy.double())
    assert y.shape == expected.shape and y.dtype == torch.float32
    assert error(y, expected) < FLOAT32_TOLERANCE, "forward output"
    for t, x in given.items():
        assert error(x.grad, leaves[t].grad) < FLOAT32_TOLERANCE, f"gradient of input {t}"
    for t in params:
        assert error(layer.spec_view(t, getattr(layer, t).grad), leaves[t].grad) < FLOAT32_TOLERANCE, f"gradient of parameter {t}"


CASES = {  # case -> (spec, --dims, its data inputs, their shapes, the output's shape, whether the attention is fused)
    "mlp_softmax": ("mlp_softmax", "", ("input",), [(5, 7)], (5, 3), False),  # output 3 wide, input 7
    "layernorm_linear_gelu": ("layernorm_linear_gelu", "", ("x",), [(3, 5, 7)], (3, 5, 9), False),  # [b,t,d] -> [b,t,f]
    "cross_attention": ("cross_attention", "", ("x", "memory"), [(2, 5, 7), (2, 6, 7)], (2, 5, 7), False),
    "cross_attention_fused": ("cross_attention", "E=16", ("x", "memory"), [(2, 5, 7), (2, 6, 7)], (2, 5, 7), True),
}  # the memory of another length than the queries; the fused attention takes head dims from 16


@pytest.mark.parametrize("backend", ["kernels", "torch"])
@pytest.mark.parametrize("case", CASES)
def test_the_layer_is_called_with_its_inputs(exported, case, backend):
    name, dims, inputs, shapes, output, fused_attention = CASES[case]
    path = exported(SPECS / f"{name}.py", dims)
    assert read_manifest(path)["inputs"] == list(inputs)
    layer = load(path, backend)
    assert ("attention_forward" in {s.kind for s in layer.plan.steps}) == fused_attention
    assert layer.interface.activations == inputs
    assert not set(inputs) & {t for t, _ in layer.named_parameters()}
    values = random_values(layer, inputs, 3)
    assert [tuple(x.shape) for x in values.values()] == shapes
    reference = CORPUS[name][1]
    check_against_torch(layer, reference, values, lambda layer, xs: layer(*xs.values()))
    check_against_torch(layer, reference, values, lambda layer, xs: layer(**dict(reversed(list(xs.items())))))
    assert tuple(layer(*values.values()).shape) == output


def test_inputs_without_requires_grad_get_none(exported):
    """Only inputs that ask for one get a gradient; every parameter still gets its own."""
    layer = load(exported(SPECS / "cross_attention.py"))
    x, memory = random_values(layer, ("x", "memory"), 4).values()
    memory.requires_grad_()
    layer(x, memory=memory).sum().backward()
    assert x.grad is None and memory.grad is not None and memory.grad.abs().sum() > 0
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in layer.parameters())


def test_wrong_calls_are_refused_naming_what_is_expected(exported):
    layer = load(exported(SPECS / "cross_attention.py"))
    x, memory = random_values(layer, ("x", "memory"), 5).values()
    call = r"the layer is called as layer\(x, memory\)"
    with pytest.raises(TypeError, match=r"missing input\(s\) memory: " + call):
        layer(x)
    with pytest.raises(TypeError, match=r"missing input\(s\) x, memory: " + call):
        layer()
    with pytest.raises(TypeError, match="3 inputs given, " + call):
        layer(x, memory, memory)
    with pytest.raises(TypeError, match="unknown input 'keys': " + call):
        layer(x, keys=memory)
    with pytest.raises(TypeError, match=r"unknown input 'wk': wk is held by the module \(layer.wk\); " + call):
        layer(x, memory, wk=layer.wk)
    with pytest.raises(TypeError, match="input 'x' given twice, by position and by name: " + call):
        layer(x, memory, x=x)
    with pytest.raises(ValueError, match=r"memory: shape \(2, 6, 5\), expected \(B, S, 7\) \(b, s, d\)"):
        layer(x, memory[..., :5])  # batch and lengths are the call's (datamove.runtime.shapes), the features the weights'
    with pytest.raises(ValueError, match="memory: B=3 along b, but B=2 elsewhere"):
        layer(x, torch.cat([memory, memory[:1]]))
    with pytest.raises(TypeError, match="memory: dtype torch.float64, expected torch.float32"):
        layer(x, memory.double())
    with pytest.raises(ValueError, match="x: on device meta, expected cpu"):
        layer(x=x.to("meta"), memory=memory)


def test_bert_and_gpt2_take_x_alone():
    for name, fused in stored_fused().items():
        assert data_inputs(fused.graph) == ("x",), name


SCALE_SHIFT = '''
    """y = x * g + b, g and b per feature: no reduction tells d from a batch letter, so the spec says."""
    from datamove.dataflow.spec import Tensor, dims

    B, T, D = dims(B=3, T=5, D=7)
    INDEX = {"b": B, "t": T, "d": D}
    INPUTS = ("x",)


    def scale_shift(x: Tensor("btd"), g: Tensor("d"), b: Tensor("d")):
        return x * g + b
'''


def scale_shift(t, m):
    return t["x"] * t["g"] + t["b"]


def test_a_spec_declares_its_inputs(exported, tmp_path):
    """Where the default rule cannot tell (every letter of x reaches the output unreduced, so g and b
    would be data), ``INPUTS`` decides: g and b are parameters, with their gradients."""
    spec = tmp_path / "scale_shift.py"
    spec.write_text(textwrap.dedent(SCALE_SHIFT))
    undeclared = tmp_path / "undeclared.py"
    undeclared.write_text(textwrap.dedent(SCALE_SHIFT).replace('INPUTS = ("x",)\n', ""))
    layer = load(exported(undeclared))
    assert layer.interface.activations == ("x", "g", "b")
    layer = load(exported(spec))
    assert layer.interface.activations == ("x",) and layer.interface.parameters == ("g", "b")
    check_against_torch(layer, scale_shift, random_values(layer, ("x",), 6), lambda layer, xs: layer(xs["x"]))


def test_inputs_in_a_declared_order_and_torch_order(exported, tmp_path):
    """``INPUTS`` also gives the order of the call, ``layer(memory, x)``, and ``TORCH_ORDER`` an
    input's dim order in PyTorch: memory [s, b, d]; x, without one, in its spec order [b, t, d]."""
    spec = tmp_path / "cross_attention_memory_first.py"
    spec.write_text((SPECS / "cross_attention.py").read_text().replace(
        'INDEX = {', 'INPUTS = ("memory", "x")\nTORCH_ORDER = {"memory": "sbd"}\nINDEX = {'))
    layer = load(exported(spec))
    assert layer.interface.activations == ("memory", "x")
    values = random_values(layer, ("x", "memory"), 7)
    check_against_torch(layer, CORPUS["cross_attention"][1], values,
                        lambda layer, xs: layer(xs["memory"].permute(1, 0, 2), xs["x"]))
    memory = values["memory"].permute(1, 0, 2).contiguous()
    np.testing.assert_array_equal(layer(memory, values["x"]).detach(), layer(x=values["x"], memory=memory).detach())
    with pytest.raises(ValueError, match=r"x: B=2 along b, but B=6 elsewhere"):
        layer(values["memory"], values["x"])  # memory (b, s, d) taken as (s, b, d): s=2, b=6


def test_a_torch_order_for_a_weight_is_refused_before_tuning(tmp_path, capsys):
    spec = tmp_path / "cross_attention_bad_order.py"
    spec.write_text((SPECS / "cross_attention.py").read_text().replace(
        'INDEX = {', 'TORCH_ORDER = {"wq": "dhe"}\nINDEX = {'))
    assert main([str(spec), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert f"{spec}: torch order wq='dhe': not a data input or output" in err, err
    assert not (tmp_path / "out").exists()
