"""configs/llama.py, a Llama-3 decoder layer written as HF writes it (pre-RMSNorm, Q/K/V/O without
biases, rotate_half RoPE, np.repeat GQA, a causal mask from np.triu, SwiGLU), through the front end:
the reference executor on its training graph (unfused and fused) against torch.autograd in float64
on a layer written here from torch's operators, at odd sizes (an odd head dim, three query heads per
key/value head), every gradient; against HF's own ``LlamaDecoderLayer`` (float64, its weights
through the spec's ``WEIGHTS``) where transformers is installed; and ``optimize-layer --analyze``.
"""
import re
import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from datamove.dataflow.executor import execute, known_value, tensor_shape
from datamove.dataflow.initial_values import CausalMask, KnownValue, initial_values
from datamove.dataflow.pipeline import analyse_spec
from datamove.dataflow.spec import load_spec
from hf_models import check_decoder_layer_against_executor
from test_executor import relative_error

warnings.filterwarnings("ignore", module="dace")

SPEC = "configs/llama.py"
ODD = dict(B=3, T=7, D=10, H=6, KV=2, E=5, F=11)  # 3 query heads per K/V head; E odd: halves of 2 and 3
EVEN = dict(B=2, T=6, D=12, H=4, KV=2, E=8, F=20)  # HF's rotary embedding needs an even head dim
WEIGHT_NAMES = ("attn_norm", "wq", "wk", "wv", "wo", "mlp_norm", "w_gate", "w_up", "w_down")


def llama_torch(t: dict, n_rep: int, eps: float = 1e-5) -> torch.Tensor:
    """The layer from torch's operators: tensors in the spec's letter orders, x [b, s, d]."""
    def rms(z, weight):
        return weight * (z * torch.rsqrt(z.pow(2).mean(-1, keepdim=True) + eps))

    def rotate(z):
        half = z.shape[-1] // 2
        return torch.cat((-z[..., half:], z[..., :half]), dim=-1)

    x, cos, sin = t["x"], t["cos"], t["sin"]
    h = rms(x, t["attn_norm"])
    q = torch.einsum("bsd,dhe->bhse", h, t["wq"])
    k = torch.einsum("bsd,dke->bkse", h, t["wk"])
    v = torch.einsum("bsd,dke->bkse", h, t["wv"])
    q, k = q * cos + rotate(q) * sin, k * cos + rotate(k) * sin
    k, v = k.repeat_interleave(n_rep, dim=1), v.repeat_interleave(n_rep, dim=1)
    context = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    x = x + torch.einsum("bhse,hed->bsd", context, t["wo"])
    h = rms(x, t["mlp_norm"])
    return x + (F.silu(h @ t["w_gate"]) * (h @ t["w_up"])) @ t["w_down"]


@pytest.fixture(scope="module")
def odd():
    return analyse_spec(SPEC, ODD)


def _inputs(graph, training, rng, cos=None, sin=None) -> dict:
    values = {n: 0.5 * rng.standard_normal(tensor_shape(graph, n)) for n, info in graph.tensors.items()
              if info.role == "input"}
    values["cos"] = rng.uniform(-1, 1, tensor_shape(graph, "cos")) if cos is None else cos
    values["sin"] = rng.uniform(-1, 1, tensor_shape(graph, "sin")) if sin is None else sin
    values[training.seeds["y"]] = rng.standard_normal(tensor_shape(graph, "y"))
    return values


def test_llama_graph_has_the_constants_it_needs(odd):
    """The rotation, the repetition and the causal mask are constants the front end made (their
    values in the graph); cos and sin the spec's own, set from the model; the mask is the causal
    mask the layer initialises (and the fused attention replaces)."""
    graph = odd.graph
    made = {t: info.letters for t, info in graph.tensors.items() if info.value}
    assert set(made) == {"concat_e", "repeat_kh", "causal"} and made["repeat_kh"] == "kh" and made["causal"] == "st"
    assert [t for t, info in graph.tensors.items() if info.role == "constant" and not info.value] == ["cos", "sin"]
    kinds = initial_values(graph, [], [t for t, info in graph.tensors.items() if info.role == "constant"])
    assert kinds["causal"] == CausalMask(rows="s", keys="t") and "cos" not in kinds
    assert isinstance(kinds["concat_e"], KnownValue) and isinstance(kinds["repeat_kh"], KnownValue)
    assert np.array_equal(known_value(graph, "repeat_kh"), np.repeat(np.eye(ODD["KV"]), ODD["H"] // ODD["KV"], axis=1))
    assert [p.expr for p in graph.primitives if p.kind == "reduce"] == ["sum", "max", "sum", "sum"]  # 2 norms, softmax


def test_llama_executor_matches_torch_autograd(odd):
    graph, training, fused = odd.graph, odd.training, odd.fused
    values = _inputs(graph, training, np.random.default_rng(7))
    result = execute(training.graph, values)
    in_fused = execute(fused.graph, values, schedule=fused.operators)
    leaves = {n: torch.tensor(values[n], requires_grad=graph.tensors[n].role == "input")
              for n in [*WEIGHT_NAMES, "x", "cos", "sin"]}
    y = llama_torch(leaves, ODD["H"] // ODD["KV"])
    assert relative_error(result["y"], y.detach().numpy()) < 1e-12
    y.backward(torch.tensor(values[training.seeds["y"]]))
    assert set(training.input_grads) == {"x", *WEIGHT_NAMES}
    for name, grad in training.input_grads.items():
        for env in (result, in_fused):
            assert relative_error(env[grad], leaves[name].grad.numpy()) < 1e-10, name


def test_llama_against_hf_decoder_layer():
    """HF's LlamaDecoderLayer (eager, float64) with the spec's WEIGHTS: the same output and the same
    gradient of every parameter and of the input, to float32's precision (HF's LlamaRMSNorm computes
    in float32 whatever the input's dtype)."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    analysis = analyse_spec(SPEC, EVEN)
    config = transformers.LlamaConfig(hidden_size=EVEN["D"], intermediate_size=EVEN["F"],
                                      num_attention_heads=EVEN["H"], num_key_value_heads=EVEN["KV"],
                                      head_dim=EVEN["E"], rms_norm_eps=1e-5, hidden_act="silu")
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    hf = LlamaDecoderLayer(config, layer_idx=0).double()
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0.0, 0.3)
    rng = np.random.default_rng(11)
    x = torch.tensor(rng.standard_normal((EVEN["B"], EVEN["T"], EVEN["D"])), requires_grad=True)
    table = load_spec(SPEC).function.__globals__["WEIGHTS"]["transformers.LlamaDecoderLayer"]
    tables = LlamaRotaryEmbedding(config)(x, torch.arange(EVEN["T"])[None])
    check_decoder_layer_against_executor(hf, table, analysis, x, tables, rng)


def test_analyze_command_on_llama(tmp_path, capsys):
    from datamove.cli import main

    out = tmp_path / "llama.json"
    assert main([SPEC, "--analyze", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "contraction" in text and "normalization" in text and '"concat_e"' in out.read_text()


def test_llama_fusion_stacks_each_tensor_once(odd):
    """The projections of K and V stack (h read once); the np.repeat einsums of K and V, which share
    their matrix, do not: v would be in two stacks, (k_x, v) and (k, v), and a stacked tensor has
    one buffer."""
    held = [set(t) for stack in odd.fused.stacks.values() for t in stack.tensors if len(t) > 1]
    assert all(not (a & b) or a == b for a in held for b in held)
    assert "stack(k_x,v)" in odd.fused.stacks and not any("k_2" in name for name in odd.fused.stacks)


def test_llama_main_job_and_exported_layer(tmp_path, capsys):
    """optimize-layer on the spec (CPU: the cost model plans), load_layer, and the layer in float32 on
    this machine against the executor, once cos and sin are set (and the constants the front end
    made, where the layer has not set them itself: ``initial_values.KnownValue``)."""
    from datamove.cli import main
    from datamove.export import load_layer

    out = tmp_path / "llama"
    assert main([SPEC, "--out", str(out), "--dims", "B=2,T=6,D=12,H=4,KV=2,E=16,F=20"]) == 0
    capsys.readouterr()
    layer = load_layer(out, dtype=torch.float32, allow_mismatch=True)
    graph = layer.graph
    x = torch.randn(2, 6, 12, requires_grad=True)
    with pytest.raises(ValueError, match=r"constant\(s\) not set: 'cos' \(over s, e: \(6, 16\)\); 'sin' .*"
                                         r"layer.set_constant\('cos', values\)"):
        layer(x)
    rng = np.random.default_rng(5)
    constants = {}
    for name in layer.interface.constants:
        buffer = layer.spec_view(name)
        if graph.tensors[name].value and not bool(buffer.isnan().any()):
            constants[name] = buffer.double().numpy()  # initialised by the layer
            continue
        constants[name] = known_value(graph, name) if graph.tensors[name].value else \
            rng.uniform(-1, 1, tuple(buffer.shape))
        with torch.no_grad():
            buffer.copy_(torch.tensor(constants[name]))
    assert np.array_equal(constants["causal"], np.where(np.triu(np.ones((6, 6)), 1) > 0, -1e4, 0.0))
    y = layer(x)
    d_y = rng.standard_normal(tuple(y.shape))
    y.backward(torch.tensor(d_y, dtype=torch.float32))
    values = {name: layer.spec_view(name).detach().double().numpy() for name, _ in layer.named_parameters()}
    values.update(constants, x=x.detach().double().numpy(), d_y=d_y)
    result = execute(graph, values)
    assert relative_error(y.detach().double().numpy(), result["y"]) < 1e-5
    assert relative_error(x.grad.double().numpy(), result["d_x"]) < 1e-4
    for name, p in layer.named_parameters():
        assert relative_error(layer.spec_view(name, p.grad).double().numpy(), result[f"d_{name}"]) < 1e-4, name


def test_multi_head_attention_is_gqa_with_groups_of_one():
    """H = KV (Llama-2's multi-head attention) through the same spec: np.repeat(x, H // KV, axis=1)
    repeats over H (KV * (H // KV) read with its division exact; it was refused as ambiguous between
    H and KV, both 4), its matrix the identity."""
    analysis = analyse_spec(SPEC, {**ODD, "H": 4, "KV": 4})
    graph = analysis.graph
    (repeat,) = [t for t, info in graph.tensors.items() if info.value and t.startswith("repeat_")]
    assert graph.letter_dims[graph.tensors[repeat].letters[1]] == "H"
    assert np.array_equal(known_value(graph, repeat), np.eye(4))


@pytest.mark.parametrize("heads", [dict(H=3, KV=2), dict(H=4, KV=8)], ids=["H=3,KV=2", "H=4,KV=8"])
def test_query_heads_no_multiple_of_kv_heads_are_refused(tmp_path, capsys, heads):
    """H not a multiple of KV: NumPy's np.repeat(k, H // KV, axis=1) then gives KV * (H // KV) heads
    that do not broadcast against q's H; the front end read the count with its division exact and
    made a layer whose last query heads attended to zero keys and values (H=3, KV=2), or summed
    every K/V head into the first (H=4, KV=8), without a word: refused at the line, in one line."""
    from datamove.cli import main

    assert main([str(SPEC), "--dims", f"H={heads['H']},KV={heads['KV']}", "--analyze"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert re.search(rf"llama.py:\d+: np.repeat\(x, n_rep, axis=1\): the repeated axis has KV\*floor\(H/KV\) = "
                     rf"{heads['KV'] * (heads['H'] // heads['KV'])} elements, H = {heads['H']} at these dims; give dims "
                     r"where it is H", err), err

