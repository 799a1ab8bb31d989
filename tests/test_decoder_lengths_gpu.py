"""Decoders at other sequence lengths than tuned, on a GPU (marker ``gpu``): the Llama layer (the
cost model's plan, float32, TF32 dots) with its kernels at T'=77 against the float64 executor; its
own CUDA graphs at T' (an untuned shape: captured on its second call) against plain launches,
the rotary tables' leading rows copied in place between steps as ``replace_llama_layers`` does
(the replays read the new rows); two siblings under FSDP2 at T', whose graphs read static copies
of the constants held at the layer's length (``runtime.graphs.SharedStatics``)."""
import warnings

import pytest
import torch

from test_decoder_lengths import check_at_length
from process_group import one_process_group
from test_graphs_gpu import close, full, replayers_of
from test_llama_gqa_gpu import DIMS, TF32_TOLERANCE, cost_model_artifact

pytestmark = pytest.mark.gpu
SHORTER = 77  # not a multiple of 16: the kernels' integer specialisation changes


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return cost_model_artifact(tmp_path_factory.mktemp("llama_lengths_gpu") / "out", DIMS)


def layers(path, count: int = 1, cuda_graphs: bool = True) -> list:
    """``count`` sibling layers in float32 on the GPU, random weights (seeded) and tables."""
    from datamove.export import load_layer

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        first = load_layer(path, device="cuda", dtype=torch.float32, allow_mismatch=True, cuda_graphs=cuda_graphs)
    result = [first] + [first.sibling() for _ in range(count - 1)]
    gen = torch.Generator().manual_seed(0)
    for layer in result:
        with torch.no_grad():
            for name, p in layer.named_parameters():
                view = layer.spec_view(name)
                view.copy_(torch.randn(view.shape, generator=gen) * (1.0 if view.dim() == 1 else view.shape[0] ** -0.5))
        for name in ("cos", "sin"):
            layer.set_constant(name, torch.rand(DIMS["T"], DIMS["E"], generator=gen) * 2 - 1)
    return result


def test_llama_kernels_at_a_shorter_length_match_the_executor(llama):
    (layer,) = layers(llama, cuda_graphs=False)
    check_at_length(layer, SHORTER, seed=1, tolerance=TF32_TOLERANCE)


def test_llama_graphs_at_a_shorter_length_match_plain_launches_with_tables_set_in_part(llama):
    (graphed,), (plain,) = layers(llama), layers(llama, cuda_graphs=False)
    gen = torch.Generator(device="cuda").manual_seed(2)
    for step in range(4):
        tables = [torch.rand(SHORTER, DIMS["E"], device="cuda", generator=gen) for _ in range(2)]
        results = []
        for layer in (graphed, plain):
            for name, table in zip(("cos", "sin"), tables):
                layer.set_constant(name, table, check_nan=False)  # the leading rows, in place
            x = torch.randn(DIMS["B"], SHORTER, DIMS["D"], device="cuda",
                            generator=torch.Generator(device="cuda").manual_seed(step)).requires_grad_()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                y = layer(x)
            y.square().mean().backward()
            results.append([y.detach(), x.grad, *[p.grad.clone() for p in layer.parameters()]])
            layer.zero_grad(set_to_none=True)
        for ours, theirs in zip(*results):
            close(ours, theirs)
    assert replayers_of(graphed) and graphed.cuda_graph_bytes() > 0  # the shorter length replayed its graphs


def test_fsdp2_siblings_at_a_shorter_length_train_as_unwrapped(llama, tmp_path):
    from torch.distributed.fsdp import fully_shard

    with one_process_group(tmp_path, "nccl"):
        sharded, plain = layers(llama, 2), layers(llama, 2, cuda_graphs=False)
        model, twin = torch.nn.Sequential(*sharded), torch.nn.Sequential(*plain)
        for layer in sharded:
            fully_shard(layer)
        fully_shard(model)
        for step in range(3):
            x = torch.randn(DIMS["B"], SHORTER, DIMS["D"], device="cuda",
                            generator=torch.Generator(device="cuda").manual_seed(step))
            results = []
            for each in (model, twin):
                x_ = x.clone().requires_grad_()
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    y = each(x_)
                y.square().mean().backward()
                results.append([y.detach(), x_.grad, *[full(p.grad) for p in each.parameters()]])
                each.zero_grad(set_to_none=True)
            for ours, theirs in zip(*results):
                close(ours, theirs)
        assert all(replayers_of(layer) for layer in sharded)
