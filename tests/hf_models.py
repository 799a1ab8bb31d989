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


def check_decoder_layer_against_executor(hf: torch.nn.Module, table: dict, analysis, x: torch.Tensor,
                                         position_embeddings: tuple, rng, tolerance: float = 1e-6) -> None:
    """HF's decoder layer ``hf`` (float64, eager attention) against the float64 executor on the spec's
    training graph (``analysis``: ``analyse_spec``'s), with ``hf``'s weights carried through the
    spec's ``WEIGHTS`` ``table`` (every parameter of ``hf`` named): the output, the input's gradient
    and every weight's, for a random upstream gradient from ``rng``.  ``x``: [B, T, D] float64
    requiring grad; ``position_embeddings``: HF's rotary (cos, sin) [1, T, E]."""
    from datamove.dataflow.executor import execute
    from datamove.runtime.weights import to_spec
    from test_executor import relative_error

    graph, training = analysis.graph, analysis.training
    cos, sin = (t.double() for t in position_embeddings)
    steps = x.shape[1]
    causal = torch.full((steps, steps), float("-inf"), dtype=torch.float64).triu(1)[None, None]
    out = hf(x, attention_mask=causal, position_embeddings=(cos, sin))
    out = out[0] if isinstance(out, tuple) else out
    assert {key for key, _, _ in table.values()} == {name for name, _ in hf.named_parameters()}
    sizes = {letter: graph.size(letter) for letter in graph.letter_dims}
    state = hf.state_dict()
    values = {name: to_spec(state[key], pattern, index, graph.tensors[name].letters, sizes).numpy()
              for name, (key, pattern, index) in table.items()}
    values.update(x=x.detach().numpy(), cos=cos[0].numpy(), sin=sin[0].numpy())
    d_y = rng.standard_normal(tuple(out.shape))
    values[training.seeds["y"]] = d_y
    result = execute(training.graph, values)
    assert relative_error(result["y"], out.detach().numpy()) < tolerance
    out.backward(torch.tensor(d_y))
    assert relative_error(result[training.input_grads["x"]], x.grad.numpy()) < tolerance
    grads = dict(hf.named_parameters())
    for name, (key, pattern, index) in table.items():
        expected = to_spec(grads[key].grad, pattern, index, graph.tensors[name].letters, sizes).numpy()
        assert relative_error(result[training.input_grads[name]], expected) < tolerance, name
