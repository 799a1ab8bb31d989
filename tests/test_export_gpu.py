"""The exported layer on a GPU at BERT-large dims (marker ``gpu``).

Accuracy by ``harness.accuracy``'s rule: a bf16/fp16 result passes when its error against a
float64 reference (the same HF ``BertLayer`` in float64, same weights, dropout off) is at most 1.5x
PyTorch's own error at that precision plus 1e-4, for the output, the input's gradient and every
parameter's; a gradient that is zero in exact arithmetic (the key bias) is judged against the
largest gradient's norm.  Then: ``torch.compile(fullgraph=True)`` against eager, a CUDA-graph
replay drawing a new dropout mask each time, and training against HF's layers.
"""
import warnings

import pytest
import torch

from datamove.dataflow.snapshot import stored_fused
from datamove.export import load_layer, load_weights, write_artifact
from datamove.runtime.weights import from_spec
from datamove.harness.bench import capture_graph
from plans import selected_plan, spec_module, spec_order_plan

pytestmark = pytest.mark.gpu

LARGE = dict(B=8, L=512, N=1024, H=16, P=64, U=4096)
SMALL = dict(B=8, L=128, N=256, H=4, P=64, U=1024)
PLANS = {"spec-order": spec_order_plan, "selected": selected_plan}


def artifact(tmp_path, dims: dict, dtype: str, plan_for) -> object:
    fused = stored_fused()["bert"].with_dims(dims)
    module = spec_module("bert")
    plan = plan_for(fused, "bert", dtype)
    return write_artifact(tmp_path / "bert", plan, fused.graph, fused.operators, spec_name="bert", spec_digest="test",
                          torch_order=module.TORCH_ORDER, weights=module.WEIGHTS,
                          device={"name": "cost model: H100", "measured": False}, versions={})


def loaded(path, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return load_layer(path, device="cuda", **kwargs)


def hf_layer(dims: dict, dropout: float = 0.0):
    import transformers
    from transformers.models.bert.modeling_bert import BertLayer

    config = transformers.BertConfig(hidden_size=dims["N"], num_attention_heads=dims["H"], intermediate_size=dims["U"],
                                     hidden_act="relu", layer_norm_eps=1e-12, attention_probs_dropout_prob=dropout,
                                     hidden_dropout_prob=dropout)
    config._attn_implementation = "eager"
    return BertLayer(config).cuda()


def _relative(result, reference, zero_scale: float) -> float:
    result, reference = result.double(), reference.double()
    scale = float(reference.norm())
    scale = scale if scale > 1e-9 * zero_scale else zero_scale
    return float((result - reference).norm()) / scale


def _grads(layer, kind: str) -> dict:
    sizes = {letter: layer.graph.size(letter) for letter in layer.graph.letter_dims}
    result = {}
    for name, (key, pattern, index) in layer.weights_table[kind].items():
        result[key] = from_spec(layer.spec_view(name, getattr(layer, name).grad), pattern, index, layer.graph.tensors[name].letters, sizes,
                                result.get(key))
    return result


def encoder_layer(dims: dict):
    return torch.nn.TransformerEncoderLayer(dims["N"], dims["H"], dims["U"], dropout=0.0, activation="relu",
                                            layer_norm_eps=1e-12, batch_first=True).cuda()


@pytest.mark.parametrize("plan", sorted(PLANS))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("make", [hf_layer, encoder_layer], ids=["BertLayer", "TransformerEncoderLayer"])
def test_bert_large_matches_pytorch_in_low_precision(tmp_path, plan, dtype, make):
    reference = make(LARGE).double().eval()
    baseline = make(LARGE).to(dtype).eval()
    baseline.load_state_dict(reference.state_dict())
    layer = loaded(artifact(tmp_path, LARGE, str(dtype).removeprefix("torch."), PLANS[plan]))
    load_weights(layer, reference).eval()
    x = torch.randn(LARGE["B"], LARGE["L"], LARGE["N"], device="cuda", dtype=torch.float64)
    dy = torch.randn_like(x)
    results = {}
    for name, module, x_in in (("ours", layer, x.to(dtype)), ("baseline", baseline, x.to(dtype)), ("reference", reference, x)):
        x_in = x_in.clone().requires_grad_()
        y = module(x_in)
        y = y[0] if isinstance(y, tuple) else y
        y.backward(dy.to(y.dtype))
        kind = next(k for k in layer.weights_table if k.endswith(type(reference).__name__))
        grads = _grads(layer, kind) if module is layer else {k: p.grad for k, p in module.named_parameters()}
        results[name] = {"y": y.detach(), "d_x": x_in.grad, **grads}
    largest = max(float(g.norm()) for k, g in results["reference"].items() if k not in ("y", "d_x"))
    failures = []
    for key, exact in results["reference"].items():
        ours = _relative(results["ours"][key], exact, largest)
        torch_error = _relative(results["baseline"][key], exact, largest)
        if not ours <= 1.5 * torch_error + 1e-4:
            failures.append(f"{key}: {ours:.3e} vs PyTorch {torch_error:.3e}")
    assert not failures, failures


@pytest.mark.parametrize("plan", sorted(PLANS))
def test_compile_fullgraph_and_cuda_graph_replay(tmp_path, plan):
    layer = loaded(artifact(tmp_path, SMALL, "bfloat16", PLANS[plan])).train()
    x = torch.randn(SMALL["B"], SMALL["L"], SMALL["N"], device="cuda", dtype=torch.bfloat16, requires_grad=True)
    torch.manual_seed(1)
    eager = layer(x)
    eager.float().square().sum().backward()
    eager_grad = x.grad.clone()
    x.grad = None
    compiled = torch.compile(layer, fullgraph=True)
    with torch._inductor.config.patch(fallback_random=True):  # inductor's own RNG differs from eager's by design
        torch.manual_seed(1)
        again = compiled(x)
    again.float().square().sum().backward()
    assert torch.equal(again, eager) and torch.equal(x.grad, eager_grad)

    static_x = x.detach().clone()
    replay, static_y = capture_graph(lambda: layer(static_x))
    outputs = []
    for _ in range(3):
        replay()
        outputs.append(static_y.clone())
    assert not torch.equal(outputs[0], outputs[1]) and not torch.equal(outputs[1], outputs[2])


def test_a_converted_layer_and_a_compiled_call_at_an_untuned_batch(tmp_path):
    """``layer.half()`` of a bf16 layer computes as a layer loaded in fp16 (its kernels made for
    fp16), and ``torch.compile(fullgraph=True)`` runs a batch size the plan was not tuned at as
    eager does (dropout off; the input gradient to fp16 rounding)."""
    path = artifact(tmp_path, SMALL, "bfloat16", selected_plan)
    layer = loaded(path).eval()
    with pytest.warns(UserWarning, match="the layer now computes in torch.float16"):
        layer.half()
    fresh = loaded(path, dtype=torch.float16, allow_mismatch=True).eval()
    fresh.load_state_dict(layer.state_dict())
    x = torch.randn(SMALL["B"], SMALL["L"], SMALL["N"], device="cuda", dtype=torch.float16)
    assert torch.equal(layer(x), fresh(x))
    compiled = torch.compile(fresh, fullgraph=True)
    odd = torch.randn(3, SMALL["L"], SMALL["N"], device="cuda", dtype=torch.float16, requires_grad=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the untuned batch size's warning
        eager = fresh(odd)
        eager.float().square().sum().backward()
        eager_grad = odd.grad.clone()
        odd.grad = None
        again = compiled(odd)
    again.float().square().sum().backward()
    assert torch.equal(again, eager)
    # the attention's dQ may be added with atomics, in another order each call: fp16 rounding
    scale = eager_grad.abs().max().item()
    torch.testing.assert_close(odd.grad, eager_grad, rtol=1e-2, atol=1e-3 * scale)


@pytest.mark.parametrize("plan", sorted(PLANS))
def test_cuda_graph_train_step(tmp_path, plan):
    """A captured forward+backward: replays in training mode draw a new mask each (output and every
    gradient change); with dropout off a replay gives eager's output and gradients (to bf16 rounding:
    kernels accumulating with atomics may add in another order)."""
    layer = loaded(artifact(tmp_path, SMALL, "bfloat16", PLANS[plan]))
    params = list(layer.parameters())
    x = torch.randn(SMALL["B"], SMALL["L"], SMALL["N"], device="cuda", dtype=torch.bfloat16, requires_grad=True)

    def step():
        y = layer(x)
        return (y, *torch.autograd.grad(y.float().square().sum(), [x] + params))

    for training in (True, False):
        layer.train(training)
        replay, static = capture_graph(step)
        replays = []
        for _ in range(3):
            replay()
            replays.append([t.clone() for t in static])
        if training:
            for first, second in zip(replays, replays[1:]):
                assert all(not torch.equal(a, b) for a, b in zip(first, second))
        else:
            for replayed, eager in zip(replays[-1], step()):
                torch.testing.assert_close(replayed, eager)



def _train(layers, steps: int, seed: int = 0) -> list[float]:
    """Two layers and a linear read-out fitting a fixed random target of the input; the losses."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    B, L, N = SMALL["B"], SMALL["L"], SMALL["N"]
    inputs = torch.randn(64, B, L, N, device="cuda", generator=gen, dtype=torch.bfloat16)
    mix = torch.randn(N, N, device="cuda", generator=gen, dtype=torch.bfloat16) / N ** 0.5
    head = torch.nn.Linear(N, N, device="cuda", dtype=torch.bfloat16)
    params = [p for layer in layers for p in layer.parameters()] + list(head.parameters())
    optimizer = torch.optim.AdamW(params, lr=3e-4)
    losses = []
    for step in range(steps):
        x = inputs[step % len(inputs)]
        y = x
        for layer in layers:
            y = layer(y)
            y = y[0] if isinstance(y, tuple) else y
        loss = torch.nn.functional.mse_loss(head(y).float(), torch.tanh(x @ mix).float())
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        losses.append(float(loss))
    return losses


@pytest.mark.parametrize("plan", sorted(PLANS))
def test_two_layers_train_like_hf(tmp_path, plan):
    """Dropout off: the spec (the paper's BERT) also drops the feed-forward activation, which HF's
    BertLayer does not, so only without dropout are the two the same function."""
    path = artifact(tmp_path, SMALL, "bfloat16", PLANS[plan])
    torch.manual_seed(0)
    hf = [hf_layer(SMALL).to(torch.bfloat16).eval() for _ in range(2)]
    ours = [loaded(path).eval() for _ in range(2)]
    for layer, reference in zip(ours, hf):
        load_weights(layer, reference)
    steps = 300
    hf_losses, our_losses = _train(hf, steps), _train(ours, steps)
    first, last = (lambda losses: sum(losses[:20]) / 20), (lambda losses: sum(losses[-20:]) / 20)
    seen = f"ours {first(our_losses):.4f} -> {last(our_losses):.4f}, HF {first(hf_losses):.4f} -> {last(hf_losses):.4f}"
    assert last(our_losses) < 0.7 * first(our_losses), seen
    assert last(our_losses) < 1.1 * last(hf_losses), seen


def test_bert_model_with_replaced_layers_trains_like_hf(tmp_path):
    """A HF ``BertModel`` (two layers, dropout off: see above) with its layers replaced in place by
    ``replace_bert_layers`` learns a token-tagging task in 300 AdamW steps as the untouched model does,
    key-padding mask passed through."""
    import copy

    import transformers

    from datamove.hf import replace_bert_layers

    d = SMALL
    config = transformers.BertConfig(hidden_size=d["N"], num_attention_heads=d["H"], intermediate_size=d["U"],
                                     num_hidden_layers=2, hidden_act="relu", layer_norm_eps=1e-12, vocab_size=97,
                                     max_position_embeddings=d["L"], attention_probs_dropout_prob=0.0,
                                     hidden_dropout_prob=0.0)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    hf = transformers.BertModel(config).cuda().to(torch.bfloat16).train()
    ours = copy.deepcopy(hf)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert replace_bert_layers(ours, artifact(tmp_path, SMALL, "bfloat16", selected_plan), dtype=torch.bfloat16) == 2
    gen = torch.Generator(device="cuda").manual_seed(1)
    ids = torch.randint(0, 97, (16, d["B"], d["L"]), device="cuda", generator=gen)
    mask = torch.ones_like(ids)
    mask[:, :, -17:] = 0  # the last 17 positions are padding: keys masked out, positions not scored
    tags = (ids * 7 + 3) % 11

    def train(model) -> list[float]:
        torch.manual_seed(2)
        head = torch.nn.Linear(d["N"], 11, device="cuda", dtype=torch.bfloat16)
        optimizer = torch.optim.AdamW(list(model.parameters()) + list(head.parameters()), lr=3e-4)
        losses = []
        for step in range(300):
            n = step % len(ids)
            hidden = model(input_ids=ids[n], attention_mask=mask[n]).last_hidden_state
            scored = mask[n].bool()
            loss = torch.nn.functional.cross_entropy(head(hidden)[scored].float(), tags[n][scored])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            losses.append(float(loss.detach()))
        return losses

    hf_losses, our_losses = train(hf), train(ours)
    first, last = (lambda losses: sum(losses[:20]) / 20), (lambda losses: sum(losses[-20:]) / 20)
    seen = f"ours {first(our_losses):.4f} -> {last(our_losses):.4f}, HF {first(hf_losses):.4f} -> {last(hf_losses):.4f}"
    assert last(our_losses) < 0.5 * first(our_losses), seen
    assert last(our_losses) < 1.1 * last(hf_losses) + 0.02, seen


def test_gpt2_causal_attention_in_low_precision(tmp_path):
    """GPT-2 with the fused causal attention in its additive mask's place (``candidates.attention_roles``),
    bf16, dropout on: the output, the input's gradient and every parameter's as close to float64
    as PyTorch's own block in bf16 with the same masks (the module doc's rule; the key bias's
    gradient, zero in exact arithmetic, judged against the largest gradient's norm)."""
    from datamove.dataflow.executor import dropout_masks
    from datamove.runtime.layer import SEED_RANGE
    from test_executor import gpt2_torch

    dims = dict(B=2, T=256, D=256, H=4, E=64, F=1024)
    fused = stored_fused()["gpt2"].with_dims(dims)
    module = spec_module("gpt2")
    plan = selected_plan(fused, "gpt2", "bfloat16")
    assert {s.config.causal_constant for s in plan.steps if s.kind.startswith("attention")} == {"causal"}
    path = write_artifact(tmp_path / "gpt2", plan, fused.graph, fused.operators, spec_name="gpt2", spec_digest="test",
                          torch_order=getattr(module, "TORCH_ORDER", {}), weights=getattr(module, "WEIGHTS", {}),
                          device={"name": "cost model: H100", "measured": False}, versions={})
    layer = loaded(path, cuda_graphs=False).train()
    gen = torch.Generator().manual_seed(1)
    T = dims["T"]
    with torch.no_grad():
        for name, p in layer.named_parameters():
            scale, shift = (0.02, 0.0) if p.dim() > 1 else (0.1, 1.0 if "gain" in name else 0.0)
            p.copy_(torch.randn(p.shape, generator=gen) * scale + shift)
        layer.spec_view("causal").copy_(torch.triu(torch.full((T, T), -1e4), diagonal=1))
    x = torch.randn(dims["B"], T, dims["D"], generator=gen).cuda()
    dy = torch.randn(dims["B"], T, dims["D"], generator=gen).cuda()
    torch.manual_seed(11)
    seed = int(torch.randint(0, SEED_RANGE, (1,), device="cuda").item())
    torch.manual_seed(11)
    ours_x = x.to(torch.bfloat16).requires_grad_()
    y = layer(ours_x)
    y.backward(dy.to(torch.bfloat16))
    ours = {"y": y.detach(), "x": ours_x.grad, **{n: layer.spec_view(n, p.grad) for n, p in layer.named_parameters()}}
    masks = {n: torch.from_numpy(m).cuda() for n, m in dropout_masks(layer.graph, seed).items()}
    results = {}
    for dtype in (torch.float64, torch.bfloat16):
        t = {n: layer.spec_view(n).detach().to(dtype).clone().requires_grad_() for n, _ in layer.named_parameters()}
        t["causal"] = layer.spec_view("causal").to(dtype)
        t["x"] = x.to(dtype).requires_grad_()
        y = gpt2_torch(t, {n: m.to(dtype) for n, m in masks.items()})
        y.backward(dy.to(dtype))
        results[dtype] = {"y": y.detach(), **{n: t[n].grad for n in ours if n != "y"}}
    reference, baseline = results[torch.float64], results[torch.bfloat16]
    largest = max(float(g.double().norm()) for n, g in reference.items() if n != "y")
    for name in ours:
        error = _relative(ours[name], reference[name], largest)
        allowed = 1.5 * _relative(baseline[name], reference[name], largest) + 1e-4
        assert error <= allowed, f"{name}: rel.err {error:.3e}, allowed {allowed:.3e}"
