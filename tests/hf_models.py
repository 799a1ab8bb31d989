"""A HF model beside a copy whose layers ``datamove.hf`` replaced, and its gradients under HF's
names: what the replacement tests (``test_llama_hf.py``, ``test_gpt2_hf.py``) compare."""
import copy
import warnings

import torch

from datamove.hf import BertLayerReplacement
from datamove.runtime.weights import from_spec


def replaced_pair(reference: torch.nn.Module, replace, artifact, layers: int, std: float,
                  dtype: torch.dtype = torch.float32):
    """(``reference`` with weights drawn N(0, ``std``), its copy with its ``layers`` layers replaced by
    ``replace`` from ``artifact`` in ``dtype``, the reference's); the cost model's plan, untuned here:
    its warnings kept quiet."""
    with torch.no_grad():
        for p in reference.parameters():
            p.normal_(0.0, std)
    ours = copy.deepcopy(reference)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert replace(ours, artifact, dtype=dtype, allow_mismatch=True) == layers
    return reference, ours


def whole(t: torch.Tensor | None) -> torch.Tensor | None:
    """An FSDP2 gradient (a sharded DTensor) whole; any other as it is."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def hf_named_grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter's gradient under HF's names (whole, under FSDP2); a replaced layer's through
    its spec's ``WEIGHTS`` (members of one HF tensor, GPT-2's stacked Q/K/V, written into one)."""
    grads = {}
    for name, module in model.named_modules():
        if isinstance(module, BertLayerReplacement):
            layer = module.layer
            sizes = {x: layer.graph.size(x) for x in layer.graph.letter_dims}
            for t, (key, pattern, index) in layer.weights_table[module.hf_kind].items():
                grads[f"{name}.{key}"] = from_spec(layer.spec_view(t, whole(getattr(layer, t).grad)), pattern, index,
                                                   layer.graph.tensors[t].letters, sizes, grads.get(f"{name}.{key}"))
    for name, p in model.named_parameters():
        if ".layer." not in name:  # the tuned layers' own, given above under HF's names
            grads[name] = whole(p.grad)
    return grads


def check_against_hf(reference: torch.nn.Module, ours: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor,
                     tolerance: float) -> None:
    """Both models on ``ids`` with ``mask`` (1 = kept), the squares of their kept outputs summed and
    differentiated: the output at every kept position and every parameter's gradient (HF's names)
    within ``tolerance`` of the reference's largest value."""
    keep = mask.bool()
    results = []
    for model in (reference, ours):
        y = model(input_ids=ids, attention_mask=mask).last_hidden_state
        y[keep].square().sum().backward()
        results.append((y.detach(), hf_named_grads(model)))
    (expected, expected_grads), (y, grads) = results
    assert float((y - expected)[keep].abs().max()) < tolerance * float(expected[keep].abs().max())
    reference_params = dict(reference.named_parameters())
    assert set(grads) == set(expected_grads) == set(reference_params)
    for name, p in reference_params.items():
        assert p.grad is not None and grads[name] is not None, name
        assert float((grads[name] - p.grad).abs().max()) < tolerance * float(p.grad.abs().max()), name


def check_padded(reference: torch.nn.Module, ours: torch.nn.Module, lengths: list[int], padded_to: int, vocab: int,
                 tolerance: float) -> None:
    """A batch of sequences of ``lengths`` padded on the right to ``padded_to`` with an attention mask
    of the padding, as a collator pads each batch to its longest sequence (``padded_to`` =
    max(lengths)) or to a fixed length (``check_against_hf``: output and every gradient against
    ``reference`` given the same); each sequence's outputs are also those of ``reference`` on the
    sequence alone, unpadded."""
    ids = torch.randint(0, vocab, (len(lengths), padded_to), generator=torch.Generator().manual_seed(len(lengths)))
    mask = torch.zeros(len(lengths), padded_to, dtype=torch.long)
    for row, length in enumerate(lengths):
        mask[row, :length] = 1
    check_against_hf(reference, ours, ids, mask, tolerance)
    padded = ours(input_ids=ids, attention_mask=mask).last_hidden_state.detach()
    for row, length in enumerate(lengths):
        alone = reference(input_ids=ids[row:row + 1, :length]).last_hidden_state.detach()[0]
        assert float((padded[row, :length] - alone).abs().max()) < tolerance * float(alone.abs().max()), row
