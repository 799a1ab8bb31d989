"""The layer's own CUDA graphs (``datamove.runtime.graphs``) keep the semantics a training loop relies on (marker ``gpu``).

Each test runs the same calls through a layer replaying its graphs and through its twin with
``cuda_graphs=False`` (same weights, same seeds: a replay draws its dropout key from PyTorch's
generator as the plain launch does) and compares outputs and gradients; kernels that add with
atomics may sum in another order, hence ``assert_close`` at bf16 rounding rather than equality.
"""
import contextlib
import warnings

import pytest
import torch

from datamove.export import load_layer
from plans import selected_plan
from process_group import one_process_group
from test_export_gpu import SMALL, artifact

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return artifact(tmp_path_factory.mktemp("graphs"), SMALL, "bfloat16", selected_plan)


def pair(path):
    """(graphed, plain) layers with the same weights."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        graphed, plain = load_layer(path, device="cuda"), load_layer(path, device="cuda", cuda_graphs=False)
    plain.load_state_dict(graphed.state_dict())
    return graphed, plain


def inputs(n: int, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return [torch.randn(SMALL["B"], SMALL["L"], SMALL["N"], device="cuda", dtype=torch.bfloat16, generator=gen)
            for _ in range(n)]


def run_steps(layer, xs: list[torch.Tensor], seed: int = 1):
    """Forward and backward of each input in turn, gradients accumulating: outputs, input grads, .grad."""
    torch.manual_seed(seed)
    outputs, grads = [], []
    for x in xs:
        x = x.clone().requires_grad_()
        y = layer(x)
        y.float().square().sum().backward()
        outputs.append(y.detach().clone())
        grads.append(x.grad)
    return outputs, grads, {name: p.grad.clone() for name, p in layer.named_parameters()}


def close(a, b):
    torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2)


def test_replays_match_plain_launches_and_accumulate_into_grad(path):
    graphed, plain = pair(path)
    xs = inputs(4)
    for _ in range(2):  # the first step captures, the second replays
        graphed.zero_grad(set_to_none=True), plain.zero_grad(set_to_none=True)
        ours, theirs = run_steps(graphed, xs), run_steps(plain, xs)
        for a, b in zip(ours[0] + ours[1], theirs[0] + theirs[1]):
            close(a, b)
        for name in ours[2]:
            close(ours[2][name], theirs[2][name])
    replayers = [r for rs in graphed.graphs.replayers.values() for r in rs]
    assert replayers and all(r.gradient_sets for r in replayers)
    assert graphed.cuda_graph_bytes() > 0


def test_plain_calls_repeating_recorded_launches_match_the_checked_path(path):
    """``cuda_graphs=False``: from its third call (the first compiles, the second records) the layer
    repeats its recorded launches (``datamove.kernels.replay``); results as a twin's whose every call
    takes the checked path."""
    _, replayed = pair(path)
    _, checked = pair(path)
    checked.load_state_dict(replayed.state_dict())
    program = checked.program(True)
    for launcher in program.forward_steps + program.backward_steps:
        launcher.replayable = False
    xs = inputs(4, seed=20)
    ours, theirs = run_steps(replayed, xs), run_steps(checked, xs)
    for a, b in zip(ours[0] + ours[1], theirs[0] + theirs[1]):
        close(a, b)
    for name in ours[2]:
        close(ours[2][name], theirs[2][name])
    program = replayed.program(True)
    repeated = [launcher for launcher in program.forward_steps + program.backward_steps if launcher.replayable]
    assert repeated and all(launcher.replay is not None for launcher in repeated)


def test_replayed_cublas_steps_call_cublaslt_only_under_default_settings(path, monkeypatch):
    """``cuda_graphs=False``: from its third call the layer's cuBLAS steps call cuBLASLt on pointers
    (``kernels.blas.LtMatmul``), with results as a twin's whose GEMMs go through PyTorch, which
    they do once PyTorch's settings differ from its defaults (bf16 reduced-precision reductions
    disallowed here): then no cuBLASLt call is made."""
    from datamove.kernels.blas import LtMatmul

    calls = []
    original = LtMatmul.__call__
    monkeypatch.setattr(LtMatmul, "__call__", lambda self, *pointers: (calls.append(self), original(self, *pointers))[1])
    _, direct = pair(path)
    _, through_torch = pair(path)
    through_torch.load_state_dict(direct.state_dict())
    xs = inputs(4, seed=30)
    ours = run_steps(direct, xs)
    assert calls
    calls.clear()
    previous = torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
    try:
        theirs = run_steps(through_torch, xs)
    finally:
        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = previous
    assert not calls
    for a, b in zip(ours[0] + ours[1], theirs[0] + theirs[1]):
        close(a, b)
    for name in ours[2]:
        close(ours[2][name], theirs[2][name])


def test_gradients_still_held_are_never_overwritten(path):
    """Every call's gradients kept (``torch.autograd.grad``): each stays its own call's."""
    graphed, plain = pair(path)
    xs = inputs(4, seed=10)
    results = []
    for layer in (graphed, plain):
        torch.manual_seed(11)
        kept = []
        for x in xs:
            x = x.clone().requires_grad_()
            kept.append(torch.autograd.grad(layer(x).float().square().sum(), [x, *layer.parameters()]))
        results.append(kept)
    for ours, theirs in zip(*results):
        for a, b in zip(ours, theirs):
            close(a, b)


def test_dropout_draws_a_new_mask_per_replay_and_the_backward_uses_it(path):
    graphed, plain = pair(path)
    x = inputs(1)[0]
    first, second = graphed(x), graphed(x)
    assert not torch.equal(first, second)
    torch.manual_seed(7)
    ours = run_steps(graphed, [x], seed=7)
    theirs = run_steps(plain, [x], seed=7)
    close(ours[0][0], theirs[0][0])
    close(ours[1][0], theirs[1][0])


def test_a_second_forward_before_the_first_backward(path):
    graphed, plain = pair(path)
    x1, x2, x3 = inputs(3, seed=2)
    results = []
    for layer in (graphed, plain):
        torch.manual_seed(3)
        layer(x1).sum().backward()  # warm: the graphed layer has captured both directions
        layer.zero_grad(set_to_none=True)
        a, b, c = (x.clone().requires_grad_() for x in (x1, x2, x3))
        ya, yb, yc = layer(a), layer(b), layer(c)  # three forwards outstanding: two replayers, then plain
        (ya.float().square().sum() + 2 * yb.float().sum() + yc.float().pow(3).mean()).backward()
        results.append([ya, yb, yc, a.grad, b.grad, c.grad] + [p.grad for p in layer.parameters()])
    for ours, theirs in zip(*results):
        close(ours.detach(), theirs.detach())


@pytest.mark.parametrize("reentrant", [True, False], ids=["reentrant", "non-reentrant"])
def test_activation_checkpointing(path, reentrant):
    graphed, _ = pair(path)
    xs = inputs(2, seed=4)
    expected = run_steps(graphed, xs, seed=5)
    graphed.zero_grad(set_to_none=True)
    torch.manual_seed(5)
    grads = []
    for x in xs:
        x = x.clone().requires_grad_()
        y = torch.utils.checkpoint.checkpoint(graphed, x, use_reentrant=reentrant)
        y.float().square().sum().backward()
        grads.append(x.grad)
    for a, b in zip(grads, expected[1]):
        close(a, b)
    for name, p in graphed.named_parameters():
        close(p.grad, expected[2][name])


def test_outputs_kept_across_calls_stay_intact(path):
    """Evaluation under no_grad, outputs collected: a replay never overwrites an output still held."""
    graphed, plain = pair(path)
    graphed.eval(), plain.eval()
    xs = inputs(4, seed=6)
    with torch.no_grad():
        ours = [graphed(x) for x in xs]
        theirs = [plain(x) for x in xs]
    for a, b in zip(ours, theirs):
        close(a, b)


def stack(layer):
    """Two layers of ``layer``'s plan, ``layer`` first, the second with its own (other) weights."""
    second = layer.sibling()
    return torch.nn.Sequential(layer, second)


def test_a_stack_of_layers_reads_the_previous_layers_outputs_in_place(path):
    """In a stack of replaced layers each layer's graphs read the previous layer's output, and the
    upstream gradient the next layer's input gradient, in place (no copy): results as plain
    launches over steps with and without accumulation, and after the first step no new capture."""
    graphed, plain = pair(path)
    graphed, plain = stack(graphed), stack(plain)
    plain[1].load_state_dict(graphed[1].state_dict())
    xs = inputs(3, seed=12)
    for step in range(3):
        if step != 1:  # step 1 accumulates into step 0's .grad
            graphed.zero_grad(set_to_none=True), plain.zero_grad(set_to_none=True)
        ours, theirs = run_steps(graphed, xs, seed=13 + step), run_steps(plain, xs, seed=13 + step)
        for a, b in zip(ours[0] + ours[1], theirs[0] + theirs[1]):
            close(a, b)
        for name in ours[2]:
            close(ours[2][name], theirs[2][name])
        if step == 0:
            captured = [(len(rs), [len(r.gradient_sets) for r in rs]) for layer in graphed
                        for rs in layer.graphs.replayers.values()]
    assert captured == [(len(rs), [len(r.gradient_sets) for r in rs]) for layer in graphed
                        for rs in layer.graphs.replayers.values()]
    first, second = ([r for rs in layer.graphs.replayers.values() for r in rs] for layer in graphed)
    assert all(r.reads == (None,) for r in first)  # a fresh input: copied
    assert all(r.reads[0] is not None for r in second)  # the first layer's output: read in place
    assert all(s.reads[0] is not None for r in first for s in r.gradient_sets)  # the second's input gradient
    assert all(s.reads == (None,) for r in second for s in r.gradient_sets)  # the loss's gradient: copied


def test_an_input_read_in_place_changed_before_the_backward_is_refused(path):
    graphed, _ = pair(path)
    layers = stack(graphed)
    x = inputs(1, seed=14)[0].requires_grad_()
    for _ in range(2):  # captures, then replays
        layers(x).float().sum().backward()
    hidden = layers[0](x)
    y = layers[1](hidden)
    assert layers[1].graphs.replayers and hidden.data_ptr() in [r.reads[0] for rs in layers[1].graphs.replayers.values()
                                                                for r in rs]
    with torch.no_grad():
        hidden.mul_(2)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.float().sum().backward()


def test_moved_parameters_are_captured_again(path):
    graphed, plain = pair(path)
    x = inputs(1, seed=8)[0]
    graphed.eval(), plain.eval()
    with torch.no_grad():
        graphed(x)
        for p, q in zip(graphed.parameters(), plain.parameters()):
            p.data = p.data * 1.5  # new storage: the graphs read the old one
            q.data = q.data * 1.5
        close(graphed(x), plain(x))


def test_hf_model_with_gradient_checkpointing(path):
    """``gradient_checkpointing_enable()`` on a HF model with replaced layers: same loss and gradients."""
    import transformers

    from datamove.hf import replace_bert_layers

    d = SMALL
    config = transformers.BertConfig(hidden_size=d["N"], num_attention_heads=d["H"], intermediate_size=d["U"],
                                     num_hidden_layers=2, hidden_act="relu", layer_norm_eps=1e-12, vocab_size=97,
                                     max_position_embeddings=d["L"], attention_probs_dropout_prob=0.1,
                                     hidden_dropout_prob=0.0)
    torch.manual_seed(0)
    model = transformers.BertModel(config).cuda().to(torch.bfloat16).train()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        replace_bert_layers(model, path, dtype=torch.bfloat16)
    ids = torch.randint(0, 97, (d["B"], d["L"]), device="cuda", generator=torch.Generator(device="cuda").manual_seed(1))
    mask = torch.ones_like(ids)
    mask[:, -9:] = 0

    def step():
        model.zero_grad(set_to_none=True)
        torch.manual_seed(9)
        loss = model(input_ids=ids, attention_mask=mask).last_hidden_state.float().square().mean()
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    step()
    plain_loss, plain_grads = step()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model.gradient_checkpointing_enable()
    ckpt_loss, ckpt_grads = step()
    close(ckpt_loss, plain_loss)
    for name, grad in plain_grads.items():
        close(ckpt_grads[name], grad)


def siblings(path, count: int, cuda_graphs: bool = True) -> list:
    """``count`` layers of one plan, each with its own weights, sharing their programs
    (``TunedLayer.sibling``): under FSDP2, one static copy of the parameters and one pool of
    gradient sets (``datamove.runtime.graphs.SharedStatics``)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        first = load_layer(path, device="cuda", cuda_graphs=cuda_graphs)
    return [first] + [first.sibling() for _ in range(count - 1)]


def plain_twins(path, layers: list) -> list:
    """Layers with ``layers``' weights and mode, launched plainly."""
    twins = siblings(path, len(layers), cuda_graphs=False)
    for twin, layer in zip(twins, layers):
        twin.load_state_dict(layer.state_dict())
        twin.train(layer.training)
    return twins


def full(t: torch.Tensor) -> torch.Tensor:
    """An FSDP2 parameter or gradient (a sharded DTensor) whole; any other tensor as it is."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def replayers_of(layer) -> list:
    """Every ``Replayer`` the layer keeps."""
    return [r for rs in layer.graphs.replayers.values() for r in rs]


@pytest.mark.parametrize("cuda_graphs", [True, False], ids=["graphs", "plain"])
def test_fsdp2_over_the_kernels_trains_as_the_unwrapped_layers(path, tmp_path, cuda_graphs):
    """Three sibling layers under ``fully_shard`` (each, then the stack; one process, NCCL), dropout
    off, three SGD steps: outputs, input gradients and every parameter after each step as the same
    layers unwrapped, launched plainly.  FSDP2 gathers the parameters into new memory for every
    call; with ``cuda_graphs`` every layer replays its graphs over one static copy of the
    parameters the three share, and the three write at most ``GRADIENT_SETS`` gradient sets among
    them (FSDP2 drops each layer's gradients after its backward).  (With spec-order views of the
    parameters kept across calls, most parameters' gradients came out ~0.5 off, relative, on an H200.)"""
    from torch.distributed.fsdp import fully_shard

    from datamove.runtime.graphs import GRADIENT_SETS

    with one_process_group(tmp_path, "nccl"):
        layers = [layer.eval() for layer in siblings(path, 3, cuda_graphs)]
        plain, sharded = torch.nn.Sequential(*plain_twins(path, layers)), torch.nn.Sequential(*layers)
        for layer in sharded:
            fully_shard(layer)
        fully_shard(sharded)
        optimizers = [torch.optim.SGD(model.parameters(), lr=0.1) for model in (plain, sharded)]
        for x in inputs(3, seed=4):
            results = []
            for model, optimizer in zip((plain, sharded), optimizers):
                x_ = x.clone().requires_grad_()
                y = model(x_)
                y.float().square().mean().backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                results.append((y.detach(), x_.grad))
            close(results[0][0], results[1][0])
            close(results[0][1], results[1][1])
        for a, b in zip(plain.parameters(), sharded.parameters()):
            close(a, full(b))
        replayers = [replayers_of(layer) for layer in sharded]
        if not cuda_graphs:
            assert not any(replayers)
            return
        assert all(layer.cuda_graph_bytes() > 0 for layer in sharded)
        assert all(rs and all(r.gradient_sets for r in rs) for rs in replayers)  # every layer's backward replayed
        assert len({id(r.shared) for rs in replayers for r in rs}) == 1
        assert len({r.others[0].data_ptr() for rs in replayers for r in rs}) == 1
        assert len({s.gradients.grads[0].data_ptr() for rs in replayers for r in rs for s in r.gradient_sets}) \
            <= GRADIENT_SETS


class _Branches(torch.nn.Module):
    """Each of ``layers`` on the same input: their outputs."""

    def __init__(self, layers):
        super().__init__()
        self.layers = torch.nn.ModuleList(layers)

    def forward(self, x):
        return [layer(x) for layer in self.layers]


def test_fsdp2_siblings_sharing_static_parameters_each_compute_with_their_own(path, tmp_path):
    """Two sibling layers under FSDP2 (the second's weights twice the first's) on one input, their
    graphs reading one static copy of the parameters: both forwards replay before either backward,
    so a backward finds the other layer's parameters copied in last and must copy its own again.
    Outputs, the input's gradient and every parameter's as unwrapped twins' launched plainly, over
    a step that captures and one that replays."""
    from torch.distributed.fsdp import fully_shard

    with one_process_group(tmp_path, "nccl"):
        layers = [layer.eval() for layer in siblings(path, 2)]
        with torch.no_grad():
            for p in layers[1].parameters():
                p.mul_(2)
        plain, sharded = _Branches(plain_twins(path, layers)), _Branches(layers)
        for layer in sharded.layers:
            fully_shard(layer)
        fully_shard(sharded)
        for x in inputs(2, seed=15):
            results = []
            for model in (plain, sharded):
                x_ = x.clone().requires_grad_()
                first, second = model(x_)
                (first.float().square().mean() + second.float().pow(3).mean()).backward()
                results.append([first.detach(), second.detach(), x_.grad, *[full(p.grad) for p in model.parameters()]])
                model.zero_grad(set_to_none=True)
            for ours, theirs in zip(results[1], results[0]):
                close(ours, theirs)
        first, second = (replayers_of(layer) for layer in sharded.layers)
        assert first and second and all(r.gradient_sets for r in first + second)
        assert first[0].others[0].data_ptr() == second[0].others[0].data_ptr()


def test_a_callers_cuda_graph_captures_forward_and_backward_with_parameter_gradients(path):
    """``torch.cuda.graph`` over a call and ``autograd.grad`` of the input and every parameter
    (after warm-up calls that replayed the layer's own graphs): captured, and its replay gives the
    plain launches' gradients.  (The layer kept autograd-recorded views of its parameters across
    calls, whose backward ran on the stream of their first call: the capture failed with
    'operation would make the legacy stream depend on a capturing blocking stream'.)"""
    from datamove.harness.bench import capture_graph

    graphed, plain = pair(path)
    graphed.eval(), plain.eval()
    x = inputs(1)[0].requires_grad_()
    dy = torch.randn_like(x)

    def step(layer):
        return torch.autograd.grad(layer(x), [x, *layer.parameters()], dy)

    for _ in range(2):
        step(graphed)
    replay, captured = capture_graph(lambda: step(graphed))
    replay()
    for a, b in zip(captured, step(plain)):
        close(a, b)


def test_a_deleted_layers_graphs_give_their_memory_back(path):
    """Loading layers again and again in one process (a notebook, a sweep, evaluating checkpoints):
    once a layer, its outputs and its gradients are gone, its graphs' memory pool and its programs'
    buffers go back to PyTorch's allocator (the first graph captured was kept for the process, and
    with it the pool every graph of the device shared).  What stays: a cuBLASLt workspace for each
    new stream a capture ran on (``kernels.blas``: one per stream, for the process)."""
    import gc
    from datamove.kernels import blas

    def settled() -> int:
        gc.collect()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        return torch.cuda.memory_reserved() - len(blas._WORKSPACES) * blas.WORKSPACE_BYTES

    before = settled()
    for _ in range(3):
        graphed, _plain = pair(path)
        run_steps(graphed, inputs(2))
        run_steps(graphed, inputs(2))  # replayed
        assert graphed.cuda_graph_bytes() > 0
        del graphed, _plain
        assert settled() - before < 4 << 20


@pytest.fixture(scope="module")
def llama_path(tmp_path_factory):
    from test_llama_gqa_gpu import DIMS, cost_model_artifact

    return cost_model_artifact(tmp_path_factory.mktemp("llama"), DIMS)


@pytest.mark.parametrize("sharded", [False, True], ids=["unsharded", "fsdp2"])
def test_rotary_tables_set_between_two_forwards_before_one_backward(llama_path, tmp_path, sharded):
    """Llama's rotary tables set anew before each of two forwards (``set_constant``, as
    ``replace_llama_layers`` does on every model call: DPO, contrastive losses), then one backward:
    each replay's backward computes with its own forward's tables.  (The graphs read the constants
    in place, and the tables were copied into them: the first call's backward read the second
    call's tables unsharded; under FSDP2 autograd's in-place check failed it.)  Float32 kernels
    replaying their graphs against the layer in float64 (the torch backend), same weights, tables
    and inputs: outputs, input gradients and every parameter's gradient."""
    from torch.distributed.fsdp import fully_shard

    from test_llama_gqa_gpu import DIMS, TF32_TOLERANCE

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        graphed = load_layer(llama_path, device="cuda", dtype=torch.float32, allow_mismatch=True)
        reference = load_layer(llama_path, device="cuda", dtype=torch.float64, allow_mismatch=True)
    gen = torch.Generator(device="cuda").manual_seed(5)
    with torch.no_grad():
        for name, p in graphed.named_parameters():
            p.copy_(torch.randn(p.shape, device="cuda", generator=gen) * (1.0 if p.dim() == 1 else p.shape[0] ** -0.5))
    reference.load_state_dict(graphed.state_dict())
    cos_shape = tuple(graphed.spec_view("cos").shape)
    tables = [[torch.rand(cos_shape, device="cuda", generator=gen) * 2 - 1 for _ in range(2)] for _ in range(2)]
    xs = torch.randn(3, DIMS["B"], DIMS["T"], DIMS["D"], device="cuda", generator=gen)
    weights = torch.randn(2, *xs.shape[1:], device="cuda", generator=gen)

    def run(layer):
        def call(table, x):
            layer.set_constant("cos", table[0])
            layer.set_constant("sin", table[1])
            x = x.to(layer.dtype, copy=True).requires_grad_()
            return x, layer(x)

        call(tables[1], xs[2])[1].sum().backward()  # warm: graphs of both directions captured
        layer.zero_grad(set_to_none=True)
        (a, ya), (b, yb) = call(tables[0], xs[0]), call(tables[1], xs[1])
        ((ya.square() * weights[0]).sum() + (ya * yb * weights[1]).sum()).backward()
        return [ya, yb, a.grad, b.grad] + [full(p.grad) for p in layer.parameters()]

    with one_process_group(tmp_path, "nccl") if sharded else contextlib.nullcontext():
        if sharded:
            fully_shard(graphed)
        ours = run(graphed)
        assert len(replayers_of(graphed)) == 2  # both forwards replayed, the second on a replayer of its own
    for mine, want in zip(ours, run(reference)):
        error = float((mine.double() - want).norm() / want.norm())
        assert error < TF32_TOLERANCE, error
