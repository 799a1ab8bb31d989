"""How the exported layer runs (CPU, Triton interpreter): its two launch paths agree, the CUDA-graph
switch, and the HF wrapper's mask conversion and activation checkpointing.

The GPU side (the layer's own CUDA graphs and the semantics a training loop relies on) is
``tests/test_graphs_gpu.py``.
"""
import pytest
import torch

from datamove.runtime.layer import SEED_RANGE
from datamove.runtime.module import layer_forward
from plans import selected_plan
from test_export import BERT_DIMS, load, randomize, small_bert_config, write

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="float32 through the Triton interpreter (CPU)")


@pytest.fixture(scope="module")
def bert(tmp_path_factory):
    return write(tmp_path_factory.mktemp("runtime"), "bert", BERT_DIMS, selected_plan)


def x_of(seed: int) -> torch.Tensor:
    return torch.randn(BERT_DIMS["B"], BERT_DIMS["L"], BERT_DIMS["N"], generator=torch.Generator().manual_seed(seed))


def test_custom_ops_match_the_eager_launch(bert):
    """``torch.compile`` traces the custom ops; an eager call launches the same steps directly:
    same output and gradients for the same dropout key (dropout on)."""
    layer = load(bert)
    randomize(layer, 4)
    program = layer.program(True)
    params = [getattr(layer, t) for t in layer.interface.parameters]
    dy = x_of(2)
    results = []
    for through_ops in (False, True):
        x = x_of(1).requires_grad_()
        torch.manual_seed(3)
        if through_ops:
            seed = torch.randint(0, SEED_RANGE, (1,))
            y = layer_forward(program.name, seed, [x, *map(layer.spec_view, layer.interface.parameters)], None)[0]
        else:
            y = layer(x)
        grads = torch.autograd.grad(y, [x, *params], dy)
        results.append([y, *grads])
    for eager, traced in zip(*results):
        torch.testing.assert_close(eager, traced, rtol=0, atol=0)


def test_cuda_graphs_switch(bert):
    """On CPU nothing is captured; on CUDA graphs are the default and ``cuda_graphs=False`` turns them off."""
    assert not load(bert).cuda_graphs
    assert load(bert).cuda_graph_bytes() == 0
    layer = load(bert, cuda_graphs=False)
    assert layer.sibling().cuda_graphs is False and layer.sibling().graphs is not layer.graphs


def test_siblings_keep_their_own_hooks(bert):
    """A hook registered on one layer runs for that layer alone (FSDP2's ``fully_shard`` registers
    its unshard and reshard as hooks: shared, each sibling ran every layer's)."""
    first = load(bert)
    second = first.sibling()
    calls = []
    first.register_forward_pre_hook(lambda module, args: calls.append(module))
    second.register_forward_hook(lambda module, args, out: calls.append(module))
    x = torch.randn(*second.program(True).shape("x", second.interface.torch_order["x"]), dtype=second.dtype)
    first(x)
    second(x)
    assert calls == [first, second]
    assert first._forward_hooks is not second._forward_hooks
    assert first._load_state_dict_pre_hooks is not second._load_state_dict_pre_hooks


def test_attention_mask_is_converted_once_per_model_call(monkeypatch):
    from datamove import hf

    calls = []
    convert = hf.key_padding_mask
    monkeypatch.setattr(hf, "key_padding_mask", lambda *args: calls.append(1) or convert(*args))
    last = hf._LastMask()
    mask = torch.ones(3, 5, dtype=torch.long)
    mask[1, 3:] = 0
    first = last(mask, 3, 5)
    assert last(mask, 3, 5) is first and len(calls) == 1  # the next layer of the same model call
    mask[2, 4] = 0  # changed in place: converted again
    assert bool(last(mask, 3, 5)[2, 4]) and len(calls) == 2
    with pytest.raises(ValueError, match=r"covers \(3, 5\)"):
        last(mask, 3, 6)


def test_hf_gradient_checkpointing(bert):
    """``gradient_checkpointing_enable()`` reaches the replaced layers and keeps their gradients (dropout on)."""
    transformers = pytest.importorskip("transformers")
    from datamove.hf import BertLayerReplacement, replace_bert_layers

    d = BERT_DIMS
    torch.manual_seed(0)
    model = transformers.BertModel(small_bert_config(transformers, attention_dropout=0.1)).train()
    assert replace_bert_layers(model, bert, dtype=torch.float32) == 2
    ids = torch.randint(0, 50, (d["B"], d["L"]), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[0, -4:] = 0

    def step():
        model.zero_grad(set_to_none=True)
        torch.manual_seed(5)
        model(input_ids=ids, attention_mask=mask).last_hidden_state.square().mean().backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    plain = step()
    model.gradient_checkpointing_enable()
    assert all(m.gradient_checkpointing for m in model.modules() if isinstance(m, BertLayerReplacement))
    checkpointed = step()
    assert plain.keys() == checkpointed.keys()
    for name, grad in plain.items():
        torch.testing.assert_close(checkpointed[name], grad, rtol=1e-5, atol=1e-6)


def test_cublas_steps_keep_their_views(bert):
    """From its second call a cuBLAS step rebuilds its operand views from the first call's (one
    ``as_strided`` each): the results equal a fresh layer's checked first call bit for bit, forward
    and backward (dropout on); a stacked operand whose members are not one storage is never kept."""
    from datamove.runtime.steps import GemmLauncher

    def run(layer, seed):
        randomize(layer, 6)
        x = x_of(seed).requires_grad_()
        torch.manual_seed(seed)
        y = layer(x)
        return [y, *torch.autograd.grad(y, [x, *[getattr(layer, t) for t in layer.interface.parameters]], x_of(9))]

    warm = load(bert)
    run(warm, 7)
    program = warm.program(True)
    gemms = [l for l in program.forward_steps + program.backward_steps
             if isinstance(l, GemmLauncher) and l.backend == "cublas" and not l.epilogue]
    assert gemms and all(l.kept_views is not None for l in gemms)
    assert any(len(members) > 1 for l in gemms for members, *_ in l.kept_views.operands)  # a stacked operand among them
    for kept, fresh in zip(run(warm, 8), run(load(bert), 8)):
        torch.testing.assert_close(kept, fresh, rtol=0, atol=0)


def test_cublas_steps_hand_cublaslt_the_pointers_of_their_views(bert, monkeypatch):
    """A replayed cuBLAS step on CUDA calls cuBLASLt (``kernels.blas.LtMatmul``) on pointers
    (``_KeptViews.pointers``) instead of building views: on every call they are the data pointers
    of the views the checked path builds from the same store, and a stacked operand whose members
    moved is refused (None: the views are derived anew)."""
    from datamove.runtime.steps import GemmLauncher

    layer = load(bert)
    program = layer.program(True)
    gemms = [l for l in program.forward_steps + program.backward_steps
             if isinstance(l, GemmLauncher) and l.backend == "cublas" and not l.epilogue]
    seen = []
    original = GemmLauncher.launch

    def launch(self, store, run):  # after each cuBLAS step: its pointers against its views on the same store
        original(self, store, run)
        if self in gemms and self.kept_views is not None:
            views = self.kept_views.views(store)
            assert self.kept_views.pointers(store) == [v.data_ptr() for v in views]
            seen.append(self.step.name)
    monkeypatch.setattr(GemmLauncher, "launch", launch)
    for seed in (7, 8, 9):
        randomize(layer, seed)
        x = x_of(seed).requires_grad_()
        torch.autograd.grad(layer(x), [x, *[getattr(layer, t) for t in layer.interface.parameters]], x_of(3))
    assert set(seen) == {l.step.name for l in gemms} and len(seen) == 3 * len(gemms)
    stacked = next(l for l in gemms if any(len(o.keys) > 1 for o in l.kept_views.operands))
    operand = next(o for o in stacked.kept_views.operands if len(o.keys) > 1)
    store = {key: torch.empty(64) for key in operand.keys}  # members apart: not at their recorded distances
    for o in stacked.kept_views.operands:
        store.update({key: torch.empty(64) for key in o.keys if key not in store})
    assert stacked.kept_views.pointers(store) is None
