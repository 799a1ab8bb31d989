"""The exported layer (``datamove.export`` / ``datamove.runtime.module``) against float64 references.

CPU: Triton through its interpreter, float32, small odd dims.  Every test compares the forward
output and every gradient (input and all parameters) with the float64 reference executor run on
the same weights and the same dropout seed (so the backward's mask is checked to be exactly the
forward's), or with the PyTorch module the weights came from (dropout off).  Errors are relative
to ||reference||, except for a gradient that is exactly zero in exact arithmetic (BERT's key
bias: softmax is shift-invariant): its result is rounding noise of the gradients it is summed
from, judged against the layer's largest gradient norm.
"""
import copy
import json
from dataclasses import replace
import re
import shutil
import warnings

import numpy as np
import pytest
import torch

from datamove.dataflow.executor import execute
from datamove.dataflow.snapshot import stored_fused
from datamove.export import (ArtifactError, ArtifactMismatch, load_layer, load_weights, read_manifest, state_dict_for,
                             write_artifact)
from datamove.runtime.weights import from_spec
from datamove.layouts.plan import LAYOUT_CHANGE, Step
from datamove.layouts.step_config import GradientEpilogueConfig, LayoutChangeConfig
from bias_join import with_joined_bias_gradients
from plans import selected_plan, spec_module, spec_order_plan

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="float32 through the Triton interpreter (CPU); "
                                "on a GPU, tests/test_export_gpu.py runs the layer at real sizes")

BERT_DIMS = dict(B=3, L=23, N=32, H=2, P=16, U=70)
GPT2_DIMS = dict(B=2, T=21, D=32, H=2, E=16, F=72)
FLOAT32_TOLERANCE = 2e-5  # interpreter float32 vs float64: measured ~3e-7; far below any indexing or mask error


def write(tmp_path, spec: str, dims: dict, plan_for=spec_order_plan, device=None, fused_as=None):
    """The artifact of ``plan_for``'s plan of ``spec`` at ``dims`` (``fused_as``: a change of the
    stored fused graph first)."""
    fused = stored_fused()[spec].with_dims(dims)
    fused = fused_as(fused) if fused_as else fused
    module = spec_module(spec)
    plan = plan_for(fused, spec)
    return write_artifact(tmp_path / spec, plan, fused.graph, fused.operators, spec_name=spec, spec_digest="test",
                          torch_order=getattr(module, "TORCH_ORDER", {}), weights=getattr(module, "WEIGHTS", {}),
                          device=device or {"name": "cost model: H100", "measured": False}, versions={})


def load(path, backend="kernels", **kwargs):
    """The artifact's layer on the CPU in float32: its kernels through the Triton interpreter
    (``backend="torch"``: its computation in PyTorch operations, ``tests/test_cpu_layer.py``)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return load_layer(path, device="cpu", dtype=torch.float32, backend=backend, **kwargs)


def error(result, reference, zero_scale: float = 0.0) -> float:
    """||result - reference|| / ||reference||, or / ``zero_scale`` where the reference is zero."""
    result, reference = np.asarray(result, dtype=np.float64), np.asarray(reference, dtype=np.float64)
    scale = float(np.linalg.norm(reference))
    scale = scale if scale > 1e-9 * zero_scale else zero_scale
    return float(np.linalg.norm(result - reference)) / scale


def randomize(layer, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, param in layer.named_parameters():
            param.copy_(torch.randn(param.shape, generator=gen))


def check_against_executor(layer, activations: dict, constants: dict | None = None, p: float | None = None) -> None:
    """Forward + backward of ``layer`` with dropout on vs the float64 executor with the same seed
    (``p=0.0``: the layer in evaluation mode vs the executor with masks of ones)."""
    face, graph = layer.interface, layer.graph
    inputs = {t: torch.randn(layer.program(True).shape(t, face.torch_order[t]), generator=torch.Generator().manual_seed(5),
                             requires_grad=True) for t in activations}
    torch.manual_seed(11)
    seed = int(torch.randint(0, 2**31 - 1, (1,)).item())
    torch.manual_seed(11)
    outputs = layer(*inputs.values())
    grad = torch.randn(outputs.shape, generator=torch.Generator().manual_seed(6))
    outputs.backward(grad)
    spec = lambda t, x: x.detach().double().permute([face.torch_order[t].index(l) for l in graph.tensors[t].letters]).numpy()  # noqa: E731
    values = {t: layer.spec_view(t).detach().double().numpy() for t, _ in layer.named_parameters()}
    values.update({t: layer.spec_view(t).double().numpy() for t, _ in layer.named_buffers()})
    values.update({t: spec(t, x) for t, x in inputs.items()})
    (out,) = face.outputs
    values[face.grad_outputs[out]] = spec(out, grad)
    env = execute(graph, values, seed=seed, p=p)
    assert error(spec(out, outputs), env[out]) < FLOAT32_TOLERANCE, "forward output"
    for t, x in inputs.items():
        assert error(spec(t, x.grad), env[face.input_grads[t]]) < FLOAT32_TOLERANCE, f"gradient of {t}"
    largest = max(np.linalg.norm(env[g]) for g in face.input_grads.values())
    for t, p in layer.named_parameters():
        assert error(layer.spec_view(t, p.grad).double().numpy(), env[face.input_grads[t]], largest) < FLOAT32_TOLERANCE, \
            f"gradient of {t}"


@pytest.mark.parametrize("plan_for", [spec_order_plan, selected_plan], ids=["spec-order", "selected"])
def test_bert_matches_the_executor_with_dropout(tmp_path, plan_for):
    layer = load(write(tmp_path, "bert", BERT_DIMS, plan_for))
    kinds = {s.kind for s in layer.plan.steps}
    assert plan_for is spec_order_plan or {"attention_forward", "attention_backward", "gemm_epilogue"} <= kinds
    folded = [s for s in layer.plan.steps if getattr(s.config, "bias", None)]  # Q/K/V's bias add inside the attention
    assert plan_for is spec_order_plan or [s.name for s in folded] == ["stack(q,k,v)+attention_forward", "attention_backward"]
    added = [s.name for s in layer.plan.steps if getattr(s.config, "residual", None)]  # d_x = d_resid1 + the GEMM's, in the GEMM
    assert plan_for is spec_order_plan or added == ["stack(d_x_via_wv_x,d_x_via_wk_x,d_x_via_wq_x)+d_x"]
    randomize(layer, 1)
    check_against_executor(layer, {"x": None})


def test_bert_gradient_epilogue_with_a_rest_matches_the_executor(tmp_path):
    """BERT with its FFN bias gradients as one operator (``tests/bias_join.py``): the gradient
    epilogue's consumer has another part, which the layer runs after the GEMM (its rest kernel)."""
    layer = load(write(tmp_path, "bert", BERT_DIMS, selected_plan, fused_as=with_joined_bias_gradients))
    (step,) = [s for s in layer.plan.steps if s.kind == "gemm_epilogue" and isinstance(s.config.epilogue, GradientEpilogueConfig)]
    assert step.name == "d_hidden+d_b1" and step.config.epilogue.rest
    assert (tmp_path / "bert" / "kernels" / "d_b1_rest.py").exists()
    randomize(layer, 2)
    check_against_executor(layer, {"x": None})


def test_bert_backward_in_evaluation_mode(tmp_path):
    """Evaluation mode (probabilities 0): the ReLU backward's keep factor (``scale_drop_act``) is 1,
    as the masks are ones."""
    layer = load(write(tmp_path, "bert", BERT_DIMS, selected_plan))
    randomize(layer, 3)
    layer.eval()
    check_against_executor(layer, {"x": None}, p=0.0)


def test_gpt2_matches_the_executor_with_dropout(tmp_path):
    layer = load(write(tmp_path, "gpt2", GPT2_DIMS, selected_plan))
    randomize(layer, 2)
    T = GPT2_DIMS["T"]
    with torch.no_grad():  # the spec's causal mask: 0 where t <= s, else -1e4
        layer.spec_view("causal").copy_(torch.triu(torch.full((T, T), -1e4), diagonal=1))
    check_against_executor(layer, {"x": None})


def test_gpt2_refuses_a_causal_constant_its_fused_attention_does_not_apply(tmp_path):
    """The fused attention applies its causal mask in place of GPT-2's additive ``causal``
    constant, so the layer checks the constant holds that mask (again after it changes)."""
    layer = load(write(tmp_path, "gpt2", GPT2_DIMS, selected_plan))
    assert {s.config.causal_constant for s in layer.plan.steps if "attention" in s.kind} == {"causal"}
    randomize(layer, 4)
    d = GPT2_DIMS
    x = torch.randn(d["B"], d["T"], d["D"], dtype=layer.dtype)
    assert torch.equal(layer.spec_view("causal"), torch.triu(torch.full((d["T"], d["T"]), -1e4), diagonal=1))  # as set
    layer(x)
    with torch.no_grad():
        layer.spec_view("causal")[0, 3] = -10.0  # a key after the query only weakened: not the causal mask
    with pytest.raises(ValueError, match="layer.causal must hold the causal mask"):
        layer(x)


def test_constants_of_known_value_that_lost_it_are_refused_on_either_backend(tmp_path, llama_artifact):
    """After ``to_empty`` (a checkpoint without the constants, HF's say): GPT-2's causal mask, whose
    plan on the torch backend reads it as it is, and Llama's front-end matrices (``rotate_half``'s)
    are refused, not computed with; ``reset_constants`` sets them again, the layer then computing as
    before (float32 here, against the layer before the reset)."""
    gpt2 = write(tmp_path, "gpt2", GPT2_DIMS, selected_plan)
    for path, name_kind in ((gpt2, "causal mask"), (llama_artifact, "values the spec gives it")):
        layer = load(path, backend="torch", allow_mismatch=True)
        randomize(layer, 6)
        program = layer.program(True)
        x = torch.randn(program.torch_shapes[layer.interface.activations[0]], generator=torch.Generator().manual_seed(7))
        if "cos" in layer.interface.constants:
            for name in ("cos", "sin"):
                layer.set_constant(name, torch.randn(layer.spec_view(name).shape))
        layer.eval()
        before = layer(x)
        kept = {n: layer.spec_view(n).clone() for n in ("cos", "sin") if n in layer.interface.constants}
        weights = {n: p.detach().clone() for n, p in layer.named_parameters()}
        layer.to_empty(device="cpu")
        with torch.no_grad():
            for n, p in layer.named_parameters():
                p.copy_(weights[n])  # a checkpoint of the weights alone
            for name in layer.initial:
                if name in layer.interface.constants:
                    layer.spec_view(name).fill_(0.5)  # what empty memory may hold
        for n, value in kept.items():
            layer.set_constant(n, value)
        with pytest.raises(ValueError, match=f"does not hold its {name_kind}.*layer.reset_constants"):
            layer(x)
        layer.reset_constants()
        for n, value in kept.items():
            layer.set_constant(n, value)
        torch.testing.assert_close(layer(x), before, rtol=0, atol=0)


def _hf_bert_layer():
    transformers = pytest.importorskip("transformers")
    from transformers.models.bert.modeling_bert import BertLayer

    d = BERT_DIMS
    config = transformers.BertConfig(hidden_size=d["N"], num_attention_heads=d["H"], intermediate_size=d["U"],
                                     hidden_act="relu", layer_norm_eps=1e-12, attention_probs_dropout_prob=0.0,
                                     hidden_dropout_prob=0.0)
    config._attn_implementation = "eager"
    return BertLayer(config).double().eval()


def _encoder_layer():
    d = BERT_DIMS
    return torch.nn.TransformerEncoderLayer(d["N"], d["H"], d["U"], dropout=0.0, activation="relu",
                                            layer_norm_eps=1e-12, batch_first=True, dtype=torch.float64).eval()


def _hf_gpt2_block():
    """HF's GPT-2 block with SDPA, which applies the causal mask itself when given no mask."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block

    d = GPT2_DIMS
    config = transformers.GPT2Config(n_embd=d["D"], n_head=d["H"], n_inner=d["F"], activation_function="gelu_new",
                                     layer_norm_epsilon=1e-5, attn_pdrop=0.0, resid_pdrop=0.0)
    config._attn_implementation = "sdpa"
    return GPT2Block(config, layer_idx=0).double().eval()


@pytest.mark.parametrize("spec,make", [("bert", _hf_bert_layer), ("bert", _encoder_layer), ("gpt2", _hf_gpt2_block)],
                         ids=["BertLayer", "TransformerEncoderLayer", "GPT2Block"])
def test_equals_the_pytorch_layer_it_replaces(tmp_path, spec, make):
    """Weights from the PyTorch module (the spec's ``WEIGHTS``), the same forward and gradients,
    the weights given back unchanged; GPT-2's (the fused causal attention) with its ``causal``
    constant as the layer initialised it."""
    reference = make()
    with torch.no_grad():
        for p in reference.parameters():
            p.normal_(0.0, 0.3)
    layer = load(write(tmp_path, "bert", BERT_DIMS) if spec == "bert" else write(tmp_path, "gpt2", GPT2_DIMS, selected_plan))
    load_weights(layer, reference).eval()
    d = BERT_DIMS if spec == "bert" else {"B": GPT2_DIMS["B"], "L": GPT2_DIMS["T"], "N": GPT2_DIMS["D"]}
    x = torch.randn(d["B"], d["L"], d["N"], dtype=torch.float64, requires_grad=True)
    x32 = x.detach().float().requires_grad_()
    y, expected = layer(x32), reference(x)
    expected = expected[0] if isinstance(expected, tuple) else expected
    grad = torch.randn_like(expected)
    y.backward(grad.float())
    expected.backward(grad)
    assert error(y.detach(), expected.detach()) < FLOAT32_TOLERANCE
    assert error(x32.grad, x.grad) < FLOAT32_TOLERANCE
    kind = next(k for k in layer.weights_table if k.endswith(type(reference).__name__))
    sizes = {letter: layer.graph.size(letter) for letter in layer.graph.letter_dims}
    reference_grads = {}
    for name, (key, pattern, index) in layer.weights_table[kind].items():
        reference_grads[key] = from_spec(layer.spec_view(name, getattr(layer, name).grad), pattern, index, layer.graph.tensors[name].letters,
                                         sizes, reference_grads.get(key))
    largest = max(float(p.grad.norm()) for p in reference.parameters())
    for key, p in reference.named_parameters():
        assert error(reference_grads[key], p.grad, largest) < FLOAT32_TOLERANCE, key
    given_back = state_dict_for(layer, kind)
    for key, value in reference.state_dict().items():
        assert torch.equal(given_back[key].double(), value.float().double()), key


@pytest.mark.parametrize("backend", ["kernels", "torch"])
def test_torch_compile_fullgraph_matches_eager(tmp_path, backend):
    """Both backends run behind the same custom ops: traced without graph breaks, at the tuned
    batch size and at others (their programs made as dynamo traces, outside its trace: the first
    untuned size once failed inside dynamo), sizes turned dynamic by a recompile included."""
    layer = load(write(tmp_path, "bert", BERT_DIMS), backend)
    randomize(layer, 3)
    d = BERT_DIMS
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    for batch in (d["B"], d["B"] + 2, d["B"] - 1):
        x = torch.randn(batch, d["L"], d["N"], requires_grad=True)
        torch.manual_seed(4)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the untuned size's warning
            layer(x).square().sum().backward()
            eager = x.grad.clone()
            x.grad = None
            torch.manual_seed(4)
            compiled(x).square().sum().backward()
        assert torch.equal(x.grad, eager), batch
    torch._dynamo.reset()


@pytest.mark.parametrize("convert, dtype", [(lambda m: m.double(), torch.float64), (lambda m: m.bfloat16(), torch.bfloat16),
                                            (lambda m: m.to(torch.float16), torch.float16)])
def test_a_converted_layer_computes_in_its_new_dtype(tmp_path, convert, dtype):
    """``layer.double()`` / ``.bfloat16()`` / ``.to(dtype)``: the layer takes inputs of the new dtype and
    computes exactly as a layer loaded in it (it once ran its first dtype's program on the converted
    parameters and refused inputs of their dtype); a sibling not converted keeps its own; a dtype the
    plan was not tuned in is warned about."""
    artifact = write(tmp_path, "bert", BERT_DIMS)
    layer = load(artifact, "torch").eval()
    randomize(layer, 3)
    twin = layer.sibling().eval()
    twin.load_state_dict(layer.state_dict())
    d = BERT_DIMS
    x = torch.randn(d["B"], d["L"], d["N"])
    before = twin(x)
    with pytest.warns(UserWarning, match=f"the layer now computes in {dtype}; its plan was tuned in torch.float32"):
        convert(layer)
    assert layer.dtype == dtype and all(p.dtype == dtype for p in layer.parameters())
    with pytest.raises(TypeError, match=f"x: dtype torch.float32, expected {dtype}"):
        layer(x)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fresh = load_layer(artifact, device="cpu", dtype=dtype, backend="torch", allow_mismatch=True).eval()
    fresh.load_state_dict(layer.state_dict())
    assert torch.equal(layer(x.to(dtype)), fresh(x.to(dtype)))
    assert torch.equal(twin(x), before)


def test_a_conversion_the_backend_cannot_compute_is_refused_before_anything_changes(tmp_path):
    """The Triton interpreter computes no bfloat16 as a GPU does, and the kernels compute in float32:
    ``.bfloat16()`` and ``.double()`` of a layer on its kernels are refused, the parameters left as
    they were (in float64 the kernels gave float32-accurate results); a layer on the default
    backend converted to float64 computes with PyTorch's operations."""
    path = write(tmp_path, "bert", BERT_DIMS)
    layer = load(path)
    with pytest.raises(ValueError, match="backend 'kernels' on cpu in torch.bfloat16: the Triton interpreter"):
        layer.bfloat16()
    with pytest.raises(ValueError, match="backend 'kernels' in torch.float64: the plan's kernels compute in float32"):
        layer.double()
    assert layer.dtype == torch.float32 and all(p.dtype == torch.float32 for p in layer.parameters())
    with pytest.raises(ValueError, match="backend 'kernels' in torch.float64"):
        load_layer(path, device="cpu", dtype=torch.float64, backend="kernels", allow_mismatch=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        default = load_layer(path, device="cpu", dtype=torch.float32)
        default.double()
    assert default.backend == "torch"


def test_a_training_loops_other_calls_on_the_torch_backend(tmp_path):
    """What a user's loop does around the layer (CPU, the torch backend, the selected plan, dropout
    off): ``torch.compile`` as eager (the custom op returned an input it keeps, and one empty tensor
    for several dropouts, which PyTorch refuses as aliasing), a padded call under
    ``torch.autocast`` as without it (bf16 scores met a float32 fill value and failed), and a second
    derivative refused in one line (it failed inside an ``out=`` op)."""
    layer = load(write(tmp_path, "bert", BERT_DIMS, selected_plan), "torch").eval()
    randomize(layer, 3)
    d = BERT_DIMS
    x = torch.randn(d["B"], d["L"], d["N"], requires_grad=True)
    mask = torch.zeros(d["B"], d["L"], dtype=torch.bool)
    mask[0, -3:] = True
    eager = layer(x, key_padding_mask=mask)
    compiled = torch.compile(layer, backend="aot_eager")
    assert torch.equal(compiled(x, key_padding_mask=mask), eager)
    torch._dynamo.reset()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.equal(layer(x, key_padding_mask=mask), eager)
    with pytest.raises(RuntimeError, match="the tuned layer's backward is not differentiable: a second derivative"):
        torch.autograd.grad(layer(x).sum(), x, create_graph=True)


def test_functional_call_uses_the_given_parameters_and_func_transforms_are_refused(tmp_path):
    """``torch.func.functional_call`` with substituted parameters computes with them (output and
    their gradients as a layer holding them), the layer's own untouched; ``torch.func.grad`` and
    ``vmap`` are refused in one line (they failed with "Cannot access data pointer of Tensor")."""
    layer = load(write(tmp_path, "bert", BERT_DIMS, selected_plan), "torch").eval()
    randomize(layer, 7)
    holder = load(write(tmp_path / "holder", "bert", BERT_DIMS, selected_plan), "torch").eval()
    gen = torch.Generator().manual_seed(8)
    given = {name: torch.randn(p.shape, generator=gen).requires_grad_() for name, p in layer.named_parameters()}
    holder.load_state_dict({**given, "_extra_state": layer.get_extra_state()}, strict=False)
    d = BERT_DIMS
    x = torch.randn(d["B"], d["L"], d["N"])
    y = torch.func.functional_call(layer, given, (x,))
    y.square().sum().backward()
    expected = holder(x)
    expected.square().sum().backward()
    assert error(y.detach(), expected.detach()) < FLOAT32_TOLERANCE
    largest = max(float(p.grad.norm()) for p in holder.parameters())
    for name, p in holder.named_parameters():
        assert error(given[name].grad, p.grad, largest) < FLOAT32_TOLERANCE, name
    assert all(p.grad is None for p in layer.parameters())
    params = {name: p.detach() for name, p in layer.named_parameters()}
    with pytest.raises(RuntimeError, match="the tuned layer does not run under torch.func transforms"):
        torch.func.grad(lambda p: torch.func.functional_call(layer, p, (x,)).sum())(params)
    with pytest.raises(RuntimeError, match="the tuned layer does not run under torch.func transforms"):
        torch.func.vmap(layer)(x.unsqueeze(0))


def test_parametrized_and_pruned_weights_are_computed_with(tmp_path):
    """A weight that ``torch.nn.utils.parametrize`` (LoRA's way) or ``prune`` computes from another
    tensor: the layer computes with it and the tensor it is computed from gets its gradient, as a
    layer holding the computed weight (they failed with a KeyError); a parameter set to a tensor
    of another shape is refused in one line (it failed in a permute)."""
    from torch.nn.utils import parametrize, prune

    class Scaled(torch.nn.Module):
        def forward(self, w):
            return 1.5 * w

    artifact = write(tmp_path, "bert", BERT_DIMS, selected_plan)
    layer, holder = load(artifact, "torch").eval(), load(artifact, "torch").eval()
    randomize(layer, 9)
    prune.l1_unstructured(layer, "w1", amount=0.5)
    parametrize.register_parametrization(layer, "wq", Scaled())
    with torch.no_grad():
        holder.load_state_dict({**{t: p for t, p in layer.named_parameters() if "." not in t and "_orig" not in t},
                                "wq": 1.5 * layer.parametrizations.wq.original, "w1": layer.w1_orig * layer.w1_mask,
                                "_extra_state": layer.get_extra_state()})
    d = BERT_DIMS
    x = torch.randn(d["B"], d["L"], d["N"])
    y, expected = layer(x), holder(x)
    assert error(y.detach(), expected.detach()) < FLOAT32_TOLERANCE
    y.square().sum().backward()
    expected.square().sum().backward()
    largest = max(float(p.grad.norm()) for p in holder.parameters())
    assert error(layer.parametrizations.wq.original.grad, 1.5 * holder.wq.grad, largest) < FLOAT32_TOLERANCE
    assert error(layer.w1_orig.grad, holder.w1.grad * layer.w1_mask, largest) < FLOAT32_TOLERANCE
    assert error(layer.wo.grad, holder.wo.grad, largest) < FLOAT32_TOLERANCE
    holder.wk.data = torch.randn(3, 3)
    with pytest.raises(ValueError, match=r"layer.wk: shape \(3, 3\), the layer's is \(16, 2, 32\)"):
        holder(x)


def test_a_layer_made_on_the_meta_device_computes_where_an_assigned_state_dict_puts_it(tmp_path):
    """``layer.to("meta")`` then ``load_state_dict(sd, assign=True)`` (the meta-device initialisation):
    the layer computes on the device and in the dtype of the tensors it was given, output and
    gradients those of the layer the state dict came from (it refused inputs, "expected meta"); a
    state dict assigning only some tensors is refused in one line."""
    artifact = write(tmp_path, "bert", BERT_DIMS, selected_plan)
    source = load(artifact, "torch")
    randomize(source, 10)
    d = BERT_DIMS
    x = torch.randn(d["B"], d["L"], d["N"], dtype=torch.float64)
    for dtype in (torch.float32, torch.float64):
        state = {k: v.to(dtype) if v.is_floating_point() else v for k, v in source.state_dict().items()}
        expected_layer = load(artifact, "torch").to(dtype)
        expected_layer.load_state_dict(state)
        layer = load(artifact, "torch").to("meta")
        layer.load_state_dict(state, assign=True)
        assert layer.device_ == torch.device("cpu") and layer.dtype == dtype
        torch.manual_seed(3)
        y = layer(x.to(dtype))
        y.square().sum().backward()
        torch.manual_seed(3)
        expected = expected_layer(x.to(dtype))
        expected.square().sum().backward()
        assert torch.equal(y, expected)
        for (name, p), q in zip(layer.named_parameters(), expected_layer.parameters()):
            assert torch.equal(p.grad, q.grad), name
    partial = load(artifact, "torch").to("meta")
    with pytest.raises(ValueError, match="the layer's parameters and constants are now in 2 dtypes or devices"):
        partial.load_state_dict({"wq": source.wq.detach().clone()}, strict=False, assign=True)


def test_a_layer_on_the_meta_device_gives_the_shapes_of_its_results(tmp_path):
    """A layer moved to the meta device and called on a meta input (shape inference, memory or FLOP
    estimates before weights exist) gives the output and every gradient of a real call's shapes and
    strides, on the meta device (it failed in the torch backend: "Tensor.item() cannot be called on
    meta tensors"); GPT-2's causal constant, holding no values there, is not checked."""
    for spec, dims, shape in (("bert", BERT_DIMS, (BERT_DIMS["B"], BERT_DIMS["L"], BERT_DIMS["N"])),
                              ("gpt2", GPT2_DIMS, (GPT2_DIMS["B"], GPT2_DIMS["T"], GPT2_DIMS["D"]))):
        layer = load(write(tmp_path, spec, dims, selected_plan), "torch").train()
        x = torch.randn(shape, requires_grad=True)
        y = layer(x)
        y.square().sum().backward()
        meta = copy.deepcopy(layer).to("meta")
        x_meta = torch.randn(shape, device="meta", requires_grad=True)
        y_meta = meta(x_meta)
        y_meta.square().sum().backward()
        assert y_meta.device.type == "meta" and (y_meta.shape, y_meta.stride()) == (y.shape, y.stride())
        assert x_meta.grad.shape == x.grad.shape
        for (name, p), q in zip(meta.named_parameters(), layer.parameters()):
            assert p.grad.device.type == "meta" and (p.grad.shape, p.grad.stride()) == (q.grad.shape, q.grad.stride()), name


def test_a_layer_saved_whole_and_loaded_elsewhere_compiles_its_own_program(tmp_path, monkeypatch):
    """``torch.save(layer)`` of a layer saved with its programs (before ``TunedLayer.__getstate__`` left
    them out) then ``torch.load`` in another process, where the name its program had is another's
    (here: another layer's training program put under it): the loaded layer under ``torch.compile``
    computes its own program, as it does eagerly and as the saved one did (it ran the other program:
    dropout in evaluation mode)."""
    import io
    from datamove.runtime import module

    artifact = write(tmp_path, "bert", BERT_DIMS, selected_plan)
    layer, other = load(artifact, "torch").eval(), load(artifact, "torch").train()
    randomize(layer, 11)
    d = BERT_DIMS
    x = torch.randn(d["B"], d["L"], d["N"])
    expected = layer(x)
    saved = io.BytesIO()
    with monkeypatch.context() as old:  # pickled as layers were: with their programs
        old.setattr(module.TunedLayer, "__getstate__", torch.nn.Module.__getstate__)
        old.delattr(module.ProgramCache, "__getstate__")
        torch.save(layer, saved)
    (name,) = [program.name for program in layer._programs.values()]
    monkeypatch.setitem(module.PROGRAMS, name, other.program(True))  # what the name is in the other process
    saved.seek(0)
    loaded = torch.load(saved, weights_only=False)
    assert torch.equal(loaded(x), expected)
    assert torch.equal(torch.compile(loaded, fullgraph=True, backend="aot_eager")(x), expected)
    torch._dynamo.reset()


def test_a_deleted_layers_programs_are_freed_and_a_pending_backward_keeps_its_own(tmp_path):
    """A process that loads layers again and again (a notebook, a sweep, evaluations of checkpoints)
    frees each layer's programs (their buffers, FSDP2's statics) with the layer: the custom ops'
    registry holds them weakly.  A forward whose layer is deleted before its backward still runs
    that backward with its own program, and a new layer's program never takes a freed one's name."""
    import gc
    import weakref
    from datamove.runtime import module

    artifact = write(tmp_path, "bert", BERT_DIMS, selected_plan)
    d = BERT_DIMS
    layer = load(artifact).train()
    randomize(layer, 5)
    x = torch.randn(d["B"], d["L"], d["N"], requires_grad=True)
    y = layer(x)
    (program,) = layer._programs.values()
    name, freed = program.name, weakref.ref(program)
    expected = torch.autograd.grad(y.sum(), x, retain_graph=True)[0]
    del layer, program
    gc.collect()
    assert freed() is not None  # y's autograd graph still needs it
    assert torch.equal(torch.autograd.grad(y.sum(), x)[0], expected)
    del y
    gc.collect()
    assert freed() is None and name not in module.PROGRAMS
    again = load(artifact).train()
    again(x)
    assert all(p.name != name for p in again._programs.values())


def test_backward_fills_no_zero_gradients(tmp_path):
    """The tensors the forward op returns for the backward get no gradient: autograd must not fill
    zero tensors for them (on the GPU those fills were 36 us of a 0.8 ms BERT-large step)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Fills(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if any(s in str(func) for s in ("zeros", "fill", "zero_")):
                self.ops.append(str(func))
            return func(*args, **(kwargs or {}))

    layer = load(write(tmp_path, "bert", BERT_DIMS)).train()
    randomize(layer, 5)
    d = BERT_DIMS
    x = torch.randn(d["B"], d["L"], d["N"], requires_grad=True)
    fills = Fills()
    with fills:
        grads = torch.autograd.grad(layer(x), [x, *layer.parameters()], torch.randn(d["B"], d["L"], d["N"]))
    assert fills.ops == []
    assert all(g is not None and torch.isfinite(g).all() and g.abs().sum() > 0 for g in grads)


def test_forward_returns_each_kept_tensor_once(tmp_path):
    """The forward op returns what the backward reads once each (a tensor returned twice is copied,
    as custom-op results may not share storage: the attention statistics were, 1.5 us on the GPU)."""
    from plans import selected_plan

    layer = load(write(tmp_path, "bert", BERT_DIMS, selected_plan))
    kept = layer.program(True).kept
    assert "lse(alpha)" in kept and len(set(kept)) == len(kept), kept


def test_stacked_weight_gradients_come_back_as_views_of_one_buffer(tmp_path):
    """The stacked GEMM writes the Q/K/V weight gradients into one buffer; the backward op returns it
    once and the autograd formula hands out its slices (no copies: custom-op results may not share
    storage, and cloning two of three cost 4 us per call on the H200).  Values: the executor test above."""
    from plans import selected_plan

    layer = load(write(tmp_path, "bert", BERT_DIMS, selected_plan)).train()
    randomize(layer, 6)
    assert [sorted(s.members) for s in layer.program(True).stacked] == [[0, 1, 2]]
    d = BERT_DIMS
    x = torch.randn(d["B"], d["L"], d["N"], requires_grad=True)
    grads = dict(zip(["x", *dict(layer.named_parameters())],
                     torch.autograd.grad(layer(x), [x, *layer.parameters()], torch.randn(d["B"], d["L"], d["N"]))))
    storages = {grads[t].untyped_storage().data_ptr() for t in ("wq", "wk", "wv")}
    assert len(storages) == 1 and all(grads[t].shape == getattr(layer, t).shape for t in ("wq", "wk", "wv"))
    assert len({grads[t].data_ptr() for t in ("wq", "wk", "wv")}) == 3


def test_refuses_wrong_inputs(tmp_path):
    layer = load(write(tmp_path, "bert", BERT_DIMS))
    d = BERT_DIMS
    good = torch.randn(d["B"], d["L"], d["N"])
    with pytest.raises(ValueError, match=r"x: shape \(3, 23, 31\), expected \(B, L, 32\) \(b, j, i\): B, L any size "
                                         r">= 1; the other sizes are fixed by the layer's tensors \(N by wq\)"):
        layer(torch.randn(d["B"], d["L"], d["N"] - 1))
    with pytest.raises(ValueError, match=r"x: shape \(3, 23\), expected"):
        layer(torch.randn(d["B"], d["L"]))
    with pytest.raises(ValueError, match=r"x: shape \(0, 23, 32\), expected"):
        layer(torch.randn(0, d["L"], d["N"]))
    with pytest.raises(TypeError, match="dtype torch.float64, expected torch.float32"):
        layer(good.double())
    with pytest.raises(TypeError, match=r"dtype torch.int64, expected torch.float32 \(the layer's dtype: convert the "
                                        r"input\)$"):  # not: convert the layer .to(torch.int64)
        layer(good.long())
    with pytest.raises(ValueError, match="on device meta, expected cpu"):
        layer(good.to("meta"))
    with pytest.raises(TypeError, match=r"2 inputs given, the layer is called as layer\(x\)"):
        layer(good, good)
    with pytest.raises(TypeError, match=r"unknown input 'wq': wq is held by the module \(layer.wq\)"):
        layer(good, wq=layer.wq)
    with pytest.raises(ValueError, match="no fused attention"):
        layer(good, key_padding_mask=torch.zeros(d["B"], d["L"], dtype=torch.bool))


def test_refuses_an_artifact_tuned_elsewhere(tmp_path):
    path = write(tmp_path, "bert", BERT_DIMS, device={"name": "NVIDIA H100 80GB HBM3", "capability": [9, 0],
                                                      "measured": True})
    with pytest.raises(ArtifactMismatch, match="tuned on NVIDIA H100 80GB HBM3, this is cpu.*allow_mismatch=True"):
        load(path)
    with pytest.raises(ArtifactMismatch, match=r"dtype torch.float16 asked for.*\(optimize-layer --dtype fp16 tunes one\)"):
        load_layer(path, device="cpu", dtype=torch.float16, allow_mismatch=False)
    with pytest.raises(ArtifactMismatch, match=r"\(no plan is tuned in torch.float64: allow_mismatch=True runs this one"):
        load_layer(path, device="cpu", dtype=torch.float64)  # it said only to re-tune, which makes no float64 plan
    assert load(path, allow_mismatch=True) is not None
    with pytest.raises(FileNotFoundError, match="not a datamove artifact"):
        load_layer(tmp_path, device="cpu")


# A damaged file of an artifact: (file, its content or None for missing, the error, what the message says is wrong).
DAMAGED = {
    "manifest not JSON": ("manifest.json", b"\x00\x9f binary", ArtifactError, "not valid JSON"),
    "manifest a list": ("manifest.json", b"[1, 2]", ArtifactError, "not a datamove manifest"),
    "manifest without keys": ("manifest.json", b'{"dims": {}, "dtype": "float32"}', ArtifactError,
                              "no device, torch_order, weights"),
    "plan missing": ("plan.json", None, FileNotFoundError, "missing"),
    "plan cut short": ("plan.json", b'{"steps": [', ArtifactError, "not valid JSON"),
    "plan without steps": ("plan.json", b"{}", ArtifactError, "not a datamove plan.json (KeyError: 'steps')"),
    "graph a list": ("graph.json", b"[]", ArtifactError, "not a datamove graph.json (TypeError"),
}


@pytest.fixture(scope="module")
def artifact(tmp_path_factory):
    return write(tmp_path_factory.mktemp("artifact"), "bert", BERT_DIMS)


@pytest.mark.parametrize("case", DAMAGED)
def test_a_damaged_artifact_file_is_named_with_what_to_do(artifact, tmp_path, case):
    name, content, error_type, problem = DAMAGED[case]
    path = shutil.copytree(artifact, tmp_path / "artifact")
    if content is None:
        (path / name).unlink()
    else:
        (path / name).write_bytes(content)
    with pytest.raises(error_type) as raised:
        load(path)
    message = str(raised.value)
    assert message.startswith(f"{path / name}: ") and problem in message, message
    assert message.endswith("write the artifact again with optimize-layer SPEC --out DIR"), message
    if name == "manifest.json":
        with pytest.raises(error_type) as raised:
            read_manifest(path)
        assert str(raised.value) == message


@pytest.mark.parametrize("field, value", [("weights", []), ("device", "cpu"), ("weights", {"BertLayer": {"wq": "x"}}),
                                          ("hf_config", [1]), ("module_config", {"torch.X": 3}),
                                          ("config_hashes", {"hf_config": 3})])
def test_a_manifest_field_of_another_shape_is_named(artifact, tmp_path, field, value):
    """A manifest whose fields are not as optimize-layer writes them (edited by hand, say) is refused
    naming the file and the field (it failed inside load_layer with an AttributeError)."""
    path = shutil.copytree(artifact, tmp_path / "artifact")
    manifest = json.loads((path / "manifest.json").read_text())
    manifest[field] = value
    (path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ArtifactError, match=rf"manifest.json: not a datamove manifest \(its {field} not as "):
        load(path)


@pytest.mark.parametrize("edit, says", [
    (lambda m: m["dims"].update(B=4), "its dims (B=4, H=2, L=23, N=32, P=16, U=70) are not plan.json's (B=3, H=2, "),
    (lambda m: m.update(dtype="float16"), "its dtype ('float16') is not plan.json's ('"),
    (lambda m: m["shapes"][0]["dims"].update(B=5), "its shapes entry of plan.json has dims {'B': 5, 'L': 23}"),
    (lambda m: m["shapes"].append({"dims": {"B": 4, "L": 23}, "plan": "plans/B4-L23.json"}),
     "its shapes entry names the plan 'plans/B4-L23.json', which is missing ("),
    (lambda m: m["shapes"].append({"dims": {"B": 4, "L": 23}, "plan": "../artifact/plan.json"}),
     "its shapes entry names the plan '../artifact/plan.json', outside the artifact's folder"),
    (lambda m: m["shapes"][0].update(plan="plans/B3-L23.json"),
     "its first shapes entry names the plan 'plans/B3-L23.json', not 'plan.json'"),
    (lambda m: m["hf_config"].update(layer_norm_eps=1e-6), "its hf_config is not the one written with the plan (its hash "),
    (lambda m: m["module_config"].update({"torch.nn.TransformerEncoderLayer": {"norm_first": True}}),
     "its module_config is not the one written with the plan (its hash "),
], ids=["dims", "dtype", "shapes", "plan missing", "plan outside", "first plan renamed", "hf_config", "module_config"])
def test_a_manifest_disagreeing_with_its_plan_is_refused_naming_the_field(artifact, tmp_path, edit, says):
    """The layer is built from plan.json and graph.json: a manifest whose dims, dtype or shapes say
    otherwise (edited by hand) was ignored by load_layer (the benchmarks read those fields); one
    whose shapes name a plan file that is not there (or the first shape's not plan.json) failed
    with a bare FileNotFoundError; one whose hf_config or module_config (what a model is checked
    against) was edited passed models the layer does not compute as."""
    path = shutil.copytree(artifact, tmp_path / "artifact")
    manifest = json.loads((path / "manifest.json").read_text())
    edit(manifest)
    (path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ArtifactError) as raised:
        load(path)
    message = str(raised.value)
    assert message.startswith(f"{path / 'manifest.json'}: {says}") and "\n" not in message, message
    assert message.endswith("write the artifact again with optimize-layer SPEC --out DIR"), message


def test_a_manifest_written_before_config_hashes_loads_its_configs_unchecked(artifact, tmp_path):
    """A manifest without ``config_hashes`` (written before they were recorded) is not checked so:
    its ``hf_config`` is the layer's as written."""
    path = shutil.copytree(artifact, tmp_path / "artifact")
    manifest = json.loads((path / "manifest.json").read_text())
    assert set(manifest["config_hashes"]) == {"hf_config", "module_config"}
    del manifest["config_hashes"]
    (path / "manifest.json").write_text(json.dumps({**manifest, "hf_config": {"layer_norm_eps": 1e-6}}))
    assert load(path).hf_config == {"layer_norm_eps": 1e-6}


def test_load_layer_refuses_a_dtype_or_device_it_cannot_take(artifact):
    with pytest.raises(ValueError, match=r"load_layer\(dtype=torch.int32\): expected torch.float32"):
        load_layer(artifact, device="cpu", dtype=torch.int32, allow_mismatch=True)
    with pytest.raises(ValueError, match=r"load_layer\(dtype='float32'\)"):
        load_layer(artifact, device="cpu", dtype="float32", allow_mismatch=True)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match=r"load_layer\(device='cuda'\): no CUDA GPU here"):
            load_layer(artifact, device="cuda", allow_mismatch=True)


def test_files_of_another_plan_than_the_manifest_are_refused(artifact, tmp_path):
    """The manifest's ``plan_id`` is a hash of plan.json and graph.json: a plan.json (or graph.json)
    of another run beside it is refused, naming the folder; a manifest written before plan_ids
    (none recorded) is not checked."""
    path = shutil.copytree(artifact, tmp_path / "artifact")
    manifest = json.loads((path / "manifest.json").read_text())
    assert len(manifest["plan_id"]) == 16 and manifest["options"] == {}
    assert load(path) is not None
    for name in ("plan.json", "graph.json"):
        original = (path / name).read_text()
        (path / name).write_text(json.dumps(json.loads(original), indent=2))  # the same JSON, another run's text
        with pytest.raises(ArtifactError) as raised:
            load(path)
        message = str(raised.value)
        assert message.startswith(f"{path}: manifest.json is of another plan ({manifest['plan_id']}) than plan.json "
                                  "and graph.json") and "\n" not in message, message
        assert message.endswith("write the artifact again with optimize-layer SPEC --out DIR"), message
        (path / name).write_text(original)
    (path / "plan.json").write_text(json.dumps(json.loads((path / "plan.json").read_text()), indent=2))
    (path / "manifest.json").write_text(json.dumps({k: v for k, v in manifest.items() if k != "plan_id"}))
    assert load(path) is not None


def test_manifest_inputs_are_read_and_checked(artifact, tmp_path):
    """The manifest's ``inputs`` are the layer's data inputs; a manifest without them (written
    before they were recorded) gets the default rule; one naming a tensor the graph lacks as an
    input with a gradient is refused, naming the file."""
    path = shutil.copytree(artifact, tmp_path / "artifact")
    manifest = json.loads((path / "manifest.json").read_text())
    (path / "manifest.json").write_text(json.dumps({**manifest, "inputs": ["x", "wq"]}))
    layer = load(path)
    assert layer.interface.activations == ("x", "wq") and "wq" not in dict(layer.named_parameters())
    (path / "manifest.json").write_text(json.dumps({k: v for k, v in manifest.items() if k != "inputs"}))
    assert load(path).interface.activations == ("x",)
    for inputs in (["x", "y"], ["x", "nothing"], [], ["x", "x"]):
        (path / "manifest.json").write_text(json.dumps({**manifest, "inputs": inputs}))
        with pytest.raises(ArtifactError) as raised:
            load(path)
        message = str(raised.value)
        assert message.startswith(f"{path / 'manifest.json'}: its interface does not fit graph.json") and \
            message.endswith("write the artifact again with optimize-layer SPEC --out DIR"), message


def test_manifest_names_what_the_layer_was_built_for(tmp_path):
    path = write(tmp_path, "bert", BERT_DIMS)
    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest["dims"] == {**stored_fused()["bert"].graph.dim_values, **BERT_DIMS}
    assert manifest["torch_order"] == {"x": "bji", "y": "bji"}
    assert manifest["inputs"] == ["x"]
    assert list((path / "kernels").glob("*.py"))


def test_each_call_draws_its_own_mask_and_the_seed_reproduces_it(tmp_path):
    layer = load(write(tmp_path, "bert", BERT_DIMS))
    randomize(layer, 4)
    d = BERT_DIMS
    x = torch.randn(d["B"], d["L"], d["N"])
    with torch.no_grad():
        torch.manual_seed(8)
        first, second = layer(x), layer(x)
        torch.manual_seed(8)
        again = layer(x)
        layer.eval()
        evaluation = [layer(x), layer(x)]
    assert not torch.equal(first, second)
    assert torch.equal(first, again)
    assert torch.equal(*evaluation)


def test_kernels_read_a_seed_kept_in_memory():
    """A key held in a device tensor (what a CUDA graph replays with) decides as the same int does."""
    from datamove.kernels.codegen import compile_operator
    from datamove.layouts.space import default_configuration

    fused = stored_fused()["bert"].with_dims(BERT_DIMS)
    graph = fused.graph
    op = next(o for o in fused.operators if any(graph.tensors[t].role == "dropout" for t in o.inputs)
              and o.cls == "elementwise")
    kernel = compile_operator(graph, op, default_configuration(graph, op))
    gen = torch.Generator().manual_seed(9)
    inputs = {t: torch.randn([graph.size(x) for x in graph.tensors[t].letters], generator=gen)
              for t in op.inputs if graph.tensors[t].role != "dropout"}
    mask = next(t for t in op.inputs if graph.tensors[t].role == "dropout")
    by_int = kernel.run(inputs, {mask: (1234567, 0)})
    by_tensor = kernel.run(inputs, {mask: (torch.tensor([1234567]), 0)})
    for t in by_int:
        assert torch.equal(by_int[t], by_tensor[t])


def small_bert_config(transformers, attention_dropout: float):
    """A two-layer HF BERT config of ``BERT_DIMS`` (vocabulary 50), hidden dropout off."""
    d = BERT_DIMS
    return transformers.BertConfig(hidden_size=d["N"], num_attention_heads=d["H"], intermediate_size=d["U"],
                                   num_hidden_layers=2, hidden_act="relu", layer_norm_eps=1e-12, vocab_size=50,
                                   max_position_embeddings=64, attention_probs_dropout_prob=attention_dropout,
                                   hidden_dropout_prob=0.0)


def small_bert_model(transformers):
    """A small HF ``BertModel`` (eval, dropout off, eager attention) with N(0, 0.3) encoder weights,
    and an untouched copy of it."""
    import copy

    config = small_bert_config(transformers, attention_dropout=0.0)
    config._attn_implementation = "eager"
    model = transformers.BertModel(config).eval()
    with torch.no_grad():
        for p in model.encoder.parameters():
            p.normal_(0.0, 0.3)
    return model, copy.deepcopy(model)


def test_replace_bert_layers_keeps_the_model(tmp_path):
    transformers = pytest.importorskip("transformers")
    from datamove.hf import BertLayerReplacement, replace_bert_layers

    d = BERT_DIMS
    model, original = small_bert_model(transformers)
    path = write(tmp_path, "bert", BERT_DIMS)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        # a float32 model and a bfloat16 layer: refused at once, not at the first call
        with pytest.raises(TypeError, match=r"the model's BertLayer weights are torch.float32 and the tuned layer "
                                            r"computes in torch.bfloat16: convert the model first"):
            replace_bert_layers(model, path, dtype=torch.bfloat16, allow_mismatch=True)
        assert not any(isinstance(layer, BertLayerReplacement) for layer in model.encoder.layer)
        assert replace_bert_layers(model, path, dtype=torch.float32) == 2
    assert all(isinstance(layer, BertLayerReplacement) for layer in model.encoder.layer)
    ids = torch.randint(0, 50, (d["B"], d["L"]), generator=torch.Generator().manual_seed(3))
    mask = torch.ones(d["B"], d["L"], dtype=torch.long)
    expected = original(input_ids=ids, attention_mask=mask, output_hidden_states=True)
    ours = model(input_ids=ids, attention_mask=mask, output_hidden_states=True)
    assert error(ours.last_hidden_state.detach(), expected.last_hidden_state.detach()) < FLOAT32_TOLERANCE
    # every layer's hidden states, as HF's own layers give them (they came back empty: HF's hooks
    # collect them from the classes the model names)
    assert len(ours.hidden_states) == len(expected.hidden_states) == 3
    for state, wanted in zip(ours.hidden_states, expected.hidden_states):
        assert error(state.detach(), wanted.detach()) < FLOAT32_TOLERANCE
    with pytest.raises(ValueError, match="output_attentions=True: the tuned layer's fused attention forms no attention weights"):
        model(input_ids=ids, attention_mask=mask, output_attentions=True)


@pytest.mark.parametrize("activation, accepted, refused", [
    ("relu", dict(hidden_act="relu"), dict(hidden_act="gelu")),  # HF's default gelu ran through relu, 0.35 off
    ("gelu", dict(hidden_act="gelu_pytorch_tanh"), dict(hidden_act="gelu")),  # the spec's gelu: tanh's, not erf's
    ("relu", dict(hidden_act="relu"), dict(hidden_act="relu", layer_norm_eps=1e-5)),
    ("relu", dict(hidden_act="relu"), dict(hidden_act="relu", hidden_dropout_prob=0.0)),
    ("relu", dict(hidden_act="relu"), dict(hidden_act="relu", num_attention_heads=4)),  # 4 x 8 fills 2 x 16's weights
], ids=["relu", "gelu", "eps", "dropout", "heads"])
def test_replace_bert_layers_refuses_a_model_configured_otherwise(tmp_path, activation, accepted, refused):
    """The main job's BERT artifact carries what its layer computes (``configs/bert.py``'s
    ``HF_CONFIG``, after ``--set activation``, at its dims): a ``BertModel`` or ``BertLayer`` configured
    otherwise is refused, naming the setting (it ran with the spec's activation, epsilon, dropout and
    head count without a word)."""
    transformers = pytest.importorskip("transformers")
    from datamove.cli import main
    from datamove.hf import replace_bert_layers

    out = tmp_path / "out"
    assert main(["configs/bert.py", "--dims", "B=3,L=23,N=32,H=2,P=16,U=70", "--set", f"activation={activation}",
                 "--out", str(out)]) == 0
    base = dict(hidden_size=32, num_attention_heads=2, intermediate_size=70, num_hidden_layers=1, vocab_size=50,
                max_position_embeddings=64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert replace_bert_layers(transformers.BertModel(transformers.BertConfig(**{**base, **accepted})), out,
                                   dtype=torch.float32, allow_mismatch=True) == 1
        key, value = next((k, v) for k, v in refused.items() if accepted.get(k) != v)
        with pytest.raises(ValueError, match=f"the model's config asks for what the tuned layer does not compute: "
                                             f"{key}={value!r}"):
            replace_bert_layers(transformers.BertModel(transformers.BertConfig(**{**base, **refused})), out, dtype=torch.float32,
                                allow_mismatch=True)
        from transformers.models.bert.modeling_bert import BertLayer

        layer = load_layer(out, device="cpu", dtype=torch.float32, allow_mismatch=True)
        if "dropout" in key:  # a layer alone: its dropout is the caller's train() / eval()
            load_weights(layer, BertLayer(transformers.BertConfig(**{**base, **refused})))
        else:  # a layer alone: its attention's config
            with pytest.raises(ValueError, match=f"{key}={value!r}"):
                load_weights(layer, BertLayer(transformers.BertConfig(**{**base, **refused})))


@pytest.mark.parametrize("refused, setting", [
    (dict(norm_first=True), "norm_first=True"), (dict(batch_first=False), "self_attn.batch_first=False"),
    (dict(layer_norm_eps=1e-5), "norm1.eps=1e-05"), (dict(nhead=4), "self_attn.num_heads=4"),
    (dict(activation="gelu"), "activation_relu_or_gelu=2"),
], ids=["norm_first", "batch_first", "eps", "heads", "gelu"])
def test_load_weights_refuses_a_torch_encoder_layer_set_otherwise(tmp_path, refused, setting):
    """``nn.TransformerEncoderLayer`` has no HF config: the main job's artifact carries the
    settings its layer computes with (``configs/bert.py``'s ``MODULE_CONFIG``), and a module set
    otherwise is refused, naming the setting (a pre-norm or sequence-first module loaded without a
    word and computed something else)."""
    from datamove.cli import main

    out = tmp_path / "out"
    assert main(["configs/bert.py", "--dims", "B=3,L=23,N=32,H=2,P=16,U=70", "--out", str(out)]) == 0
    layer = load(out, allow_mismatch=True)
    base = dict(d_model=32, nhead=2, dim_feedforward=70, dropout=0.0, activation="relu", layer_norm_eps=1e-12,
                batch_first=True)
    load_weights(layer, torch.nn.TransformerEncoderLayer(**base))
    with pytest.raises(ValueError, match=f"load_weights: the TransformerEncoderLayer computes otherwise than the "
                                         f"tuned layer: {re.escape(setting)} .the tuned layer computes"):
        load_weights(layer, torch.nn.TransformerEncoderLayer(**{**base, **refused}))


def test_a_config_value_that_is_a_dict_is_compared_as_a_value():
    """A config table's dict value (a manifest's written before the job refused dicts in HF_CONFIG
    but {"at least": n}, or a MODULE_CONFIG's) is compared as a value, beside a lower bound (1109234:
    the check read its "at least" and stopped in a KeyError)."""
    from types import SimpleNamespace

    from datamove.export import check_config

    scaling = {"rope_type": "linear", "factor": 2.0}
    computed = {"rope_scaling": scaling, "sliding_window": [None, {"at least": 16}]}
    assert check_config(SimpleNamespace(rope_scaling=dict(scaling), sliding_window=16), computed) is False
    with pytest.raises(ValueError, match=r"rope_scaling=\{'rope_type': 'linear', 'factor': 4.0\} \(the tuned layer "
                                         r"computes \{'rope_type': 'linear', 'factor': 2.0\}\); sliding_window=8 \(the "
                                         r"tuned layer computes None or at least 16\)"):
        check_config(SimpleNamespace(rope_scaling={**scaling, "factor": 4.0}, sliding_window=8), computed)


def test_the_weight_functions_and_replace_refuse_what_they_cannot_read_in_one_line(tmp_path):
    """Arguments swapped or not a tuned layer, a module whose weights are not made yet (meta), no
    model at all: one line each (they failed inside torch or datamove); an input of another dtype
    says how to convert."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.bert.modeling_bert import BertLayer

    from datamove.hf import replace_bert_layers

    layer = load(write(tmp_path, "bert", BERT_DIMS), "torch")
    d = BERT_DIMS
    config = transformers.BertConfig(hidden_size=d["N"], num_attention_heads=d["H"], intermediate_size=d["U"],
                                     hidden_act="relu", layer_norm_eps=1e-12)
    with pytest.raises(TypeError, match="state_dict_for: the first argument is the tuned layer .load_layer's., not a Linear"):
        state_dict_for(torch.nn.Linear(3, 3), "transformers.BertLayer")
    with pytest.raises(TypeError, match="load_weights: the first argument is the tuned layer"):
        load_weights(BertLayer(config), layer)
    with pytest.raises(ValueError, match="load_weights: the BertLayer's weights are on the meta device"):
        load_weights(layer, BertLayer(config).to("meta"))
    kinds = "torch.nn.TransformerEncoderLayer, transformers.BertLayer"
    with pytest.raises(TypeError, match=rf"^load_weights: a torch.Linear is not a module the tuned layer takes weights "
                                        rf"from: its spec's WEIGHTS name {kinds}; give a module of one of those kinds, "
                                        r"or add its kind to the spec's WEIGHTS and run optimize-layer again$"):
        load_weights(layer, torch.nn.Linear(4, 4))  # it raised a bare KeyError
    with pytest.raises(TypeError, match=rf"^load_weights: the second argument is the module whose weights to copy \(a "
                                        rf"torch.nn.Module of a kind the spec's WEIGHTS name: {kinds}\), got OrderedDict$"):
        load_weights(layer, BertLayer(config).state_dict())
    with pytest.raises(ValueError, match=rf"^the spec gives no weights for 'torch.Linear'; its WEIGHTS name {kinds}: "
                                         "ask for one of those$"):
        state_dict_for(layer, "torch.Linear")
    with pytest.raises(TypeError, match="replacing the BertLayers of a model: expected a HF model .a torch.nn.Module., got NoneType"):
        replace_bert_layers(None, tmp_path / "bert")
    with pytest.raises(TypeError, match=r"x: dtype torch.float64, expected torch.float32 \(the layer's dtype: convert "
                                        r"the input, or the layer and its model with .to\(torch.float64\)\)"):
        layer(torch.randn(d["B"], d["L"], d["N"], dtype=torch.float64))
    with pytest.raises(KeyError, match=r"spec_view\('wz'\): not a parameter or constant of the layer; it has "):
        layer.spec_view("wz")  # it said: 'TunedLayer' object has no attribute 'wz'


def test_stack_groups_follow_their_partners_through_the_plan():
    """The gradients' stack, first met beside the unstacked x, takes the weights' order because a
    later GEMM pairs the two: both are then read as views of their buffers, no copy per call."""
    from datamove.runtime.steps import stack_groups
    from datamove.layouts.plan import GEMM, Step
    from datamove.layouts.step_config import ContractionConfig

    def gemm(name, a, b, out):
        return Step(name, "forward", GEMM, (name,), {}, {}, ContractionConfig("", "cublas", {"a": a, "b": b, "out": out}),
                    0.0, "predicted")

    steps = [gemm("qkv", ["wq", "wk", "wv"], ["x"], ["q", "k", "v"]),
             gemm("d_w", ["d_v", "d_k", "d_q"], ["x"], ["d_wv", "d_wk", "d_wq"]),
             gemm("d_x", ["wv", "wk", "wq"], ["d_v", "d_k", "d_q"], ["d_x"])]
    assert stack_groups(steps) == [["wq", "wk", "wv"], ["q", "k", "v"], ["d_q", "d_k", "d_v"], ["d_wq", "d_wk", "d_wv"]]
    with pytest.raises(ValueError, match="overlaps another stack group"):
        stack_groups(steps + [gemm("bad", ["wq", "wk"], ["x"], ["y"])])


@pytest.mark.parametrize("spec,dims", [("gpt2", dict(GPT2_DIMS, B=1)), ("bert", dict(BERT_DIMS, B=1))], ids=["gpt2", "bert"])
def test_a_batch_of_one_runs_the_selected_plan(tmp_path, spec, dims):
    """At B=1 the batch letter's stride says nothing of where it sits: a stacked GEMM's output
    stored 'thebs' reads as 'thbes', which is no GEMM; any place of a letter of size 1 is tried."""
    layer = load(write(tmp_path, spec, dims, selected_plan))
    randomize(layer, 5)
    check_against_executor(layer, {"x": None})  # GPT-2's causal constant as the layer sets it


def test_a_batch_of_one_is_read_in_place_whatever_its_batch_stride(tmp_path):
    """The stride of a dim of size 1 says nothing: an input of one sequence whose batch stride is
    not the plan's is read in place, not copied, and gives the same output."""
    layer = load(write(tmp_path, "bert", dict(BERT_DIMS, B=1), selected_plan))
    randomize(layer, 5)
    program = layer.program(True)
    x = torch.randn(program.torch_shapes["x"], generator=torch.Generator().manual_seed(3))
    odd = x.as_strided(x.shape, (x.stride(0) + 7, *x.stride()[1:]))  # the same elements, batch stride apart
    assert odd.stride() != x.stride() and program.to_spec("x", odd, "x").data_ptr() == odd.data_ptr()
    layer.eval()
    with torch.no_grad():
        assert torch.equal(layer(odd), layer(x))


def _one_copy_for_two_phases(fused, spec: str):
    """The spec-order plan with the FFN's GEMMs reading x1 (ibj) as bji: one layout change after
    x1 is written, whose copy w1_x1 reads in the forward and d_w1 in the backward (the runtime
    keeps it for the backward)."""
    plan = spec_order_plan(fused, spec)
    steps = []
    for step in plan.steps:
        if step.name in ("w1_x1", "d_w1"):
            step = replace(step, reads={**step.reads, "x1": "bji"})
        steps.append(step)
        if step.name == "x1":
            steps.append(Step("layout(x1:ibj->bji)#0", "forward", LAYOUT_CHANGE, (), {"x1": "ibj"}, {},
                              LayoutChangeConfig("x1", "ibj", "bji"), 0.0, "predicted"))
    return replace(plan, steps=steps)


def test_a_forward_layout_copy_read_again_by_the_backward(tmp_path):
    layer = load(write(tmp_path, "bert", BERT_DIMS, _one_copy_for_two_phases))
    assert [s.name for s in layer.plan.steps if s.kind == LAYOUT_CHANGE] == ["layout(x1:ibj->bji)#0"]
    assert "x1@bji" in layer.program(True).kept  # the forward's copy, returned for the backward
    randomize(layer, 4)
    check_against_executor(layer, {"x": None})


QKV_GRADIENTS_CHANGED = {"d_v": "whkb", "d_k": "phkb", "d_q": "phjb"}  # the stacked backward GEMMs read these


def _stacked_gradients_changed(fused, spec: str):
    """The spec-order plan at B=1 with both stacked backward GEMMs (d_W and d_x of Q/K/V) reading
    d_q, d_k and d_v with the batch letter innermost: three layout changes after the last of them
    is written, each member's copy (Llama's plan does this with its K/V gradients).  Only at B=1
    can those GEMMs read that order (x is stored ibj), and the copies' bytes are the originals'."""
    steps = []
    for step in spec_order_plan(fused, spec).steps:
        if step.name.startswith(("stack(d_wv", "stack(d_x_via")):
            step = replace(step, reads={**step.reads, **QKV_GRADIENTS_CHANGED})
        steps.append(step)
        if step.name == "d_q":
            steps += [Step(f"layout({t}:{source}->{target})#{n}", "backward", LAYOUT_CHANGE, (), {t: source}, {},
                           LayoutChangeConfig(t, source, target), 0.0, "predicted")
                      for n, (t, target) in enumerate(QKV_GRADIENTS_CHANGED.items())
                      for source in [fused.graph.tensors[t].letters]]
    return replace(spec_order_plan(fused, spec), steps=steps)


def test_stacked_gemms_read_the_copies_of_one_buffer(tmp_path, monkeypatch):
    """A stacked GEMM reading every member through a layout change reads the changes' copies as
    one buffer, a view: no stacking copy per GEMM (two GEMMs, a copy of every member each, before)."""
    from datamove.runtime import steps as launchers

    layer = load(write(tmp_path, "bert", dict(BERT_DIMS, B=1), _stacked_gradients_changed))
    assert ["d_q@phjb", "d_k@phkb", "d_v@whkb"] in launchers.stack_groups(layer.plan.steps)  # the weights' order
    stacked_view = launchers.stacked_view

    def viewed(members):
        assert launchers._spacing(members) is not None, "a stacked operand was copied"
        return stacked_view(members)
    monkeypatch.setattr(launchers, "stacked_view", viewed)
    randomize(layer, 4)
    check_against_executor(layer, {"x": None})
