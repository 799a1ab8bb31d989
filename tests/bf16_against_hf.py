"""A bf16 artifact of the main job on the CPU, as a user runs it: no environment variable set.

``python tests/bf16_against_hf.py SPEC DIMS OUT`` runs ``optimize-layer SPEC --dims DIMS --out OUT``
(the default dtype, bf16), loads the layer with ``load_layer(OUT)`` (every default), copies the
weights of a HF module with random weights into it (``load_weights``), and prints one JSON line:
the relative errors (||result - reference|| / ||reference||) of the forward output, the input
gradient and each weight gradient, against that HF module in float64, for the layer and for the
HF module itself in bf16 (PyTorch's own bf16 error), in evaluation mode (dropout off).
``tests/test_cpu_layer.py`` runs it in a subprocess without ``TRITON_INTERPRET``.
"""
import json
import sys
import warnings

import torch
import transformers

from datamove.cli import main
from datamove.export import load_layer, load_weights
from datamove.runtime.weights import from_spec


def hf_module(spec: str, dims: dict) -> torch.nn.Module:
    if spec == "bert":
        from transformers.models.bert.modeling_bert import BertLayer

        config = transformers.BertConfig(hidden_size=dims["N"], num_attention_heads=dims["H"],
                                         intermediate_size=dims["U"], hidden_act="relu", layer_norm_eps=1e-12,
                                         attention_probs_dropout_prob=0.0, hidden_dropout_prob=0.0)
        config._attn_implementation = "eager"
        return BertLayer(config)
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block

    config = transformers.GPT2Config(n_embd=dims["D"], n_head=dims["H"], n_inner=dims["F"],
                                     activation_function="gelu_new", layer_norm_epsilon=1e-5, attn_pdrop=0.0,
                                     resid_pdrop=0.0)
    config._attn_implementation = "sdpa"
    return GPT2Block(config, layer_idx=0)


def error(result: torch.Tensor, reference: torch.Tensor, zero_scale: float = 0.0) -> float:
    """||result - reference|| / ||reference||, or / ``zero_scale`` where the reference is zero in exact
    arithmetic (BERT's key bias gradient: softmax is shift-invariant) and rounding noise in float64."""
    result, reference = result.detach().double(), reference.detach().double()
    scale = float(torch.linalg.norm(reference))
    return float(torch.linalg.norm(result - reference)) / (scale if scale > 1e-9 * zero_scale else zero_scale)


def run(module: torch.nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(output, input gradient for ``dy``, dy) of a module taking [batch, sequence, features]."""
    x = x.clone().requires_grad_()
    y = module(x)
    y = y[0] if isinstance(y, tuple) else y
    dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(7), dtype=torch.float64).to(y.dtype)
    y.backward(dy)
    return y, x.grad


def main_(spec: str, dims_text: str, out: str) -> dict:
    dims = {k: int(v) for k, v in (item.split("=") for item in dims_text.split(","))}
    assert main([f"configs/{spec}.py", "--dims", dims_text, "--out", out]) == 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the cost model's plan: nothing measured
        layer = load_layer(out)
    torch.manual_seed(0)
    reference = hf_module(spec, dims).double().eval()
    with torch.no_grad():
        for p in reference.parameters():
            p.normal_(0.0, 0.1)
    load_weights(layer, reference).eval()
    low = hf_module(spec, dims).to(layer.dtype).eval()
    low.load_state_dict(reference.state_dict())
    batch, length, width = (dims["B"], dims["L"], dims["N"]) if spec == "bert" else (dims["B"], dims["T"], dims["D"])
    x = torch.randn(batch, length, width, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    expected, expected_dx = run(reference, x)
    ours, ours_dx = run(layer, x.to(layer.dtype))
    hf, hf_dx = run(low, x.to(layer.dtype))
    result = {"backend": layer.backend, "dtype": str(layer.dtype),
              "output": [error(ours, expected), error(hf, expected)], "input_grad": [error(ours_dx, expected_dx),
                                                                               error(hf_dx, expected_dx)]}
    kind = next(k for k in layer.weights_table if k.endswith(type(reference).__name__))
    sizes = {letter: layer.graph.size(letter) for letter in layer.graph.letter_dims}
    grads = {}
    for name, (key, pattern, index) in layer.weights_table[kind].items():
        grads[key] = from_spec(layer.spec_view(name, getattr(layer, name).grad).double(), pattern, index, layer.graph.tensors[name].letters,
                               sizes, grads.get(key))
    low_grads = dict(low.named_parameters())
    largest = max(float(p.grad.norm()) for p in reference.parameters())
    for key, p in reference.named_parameters():
        result[key] = [error(grads[key], p.grad, largest), error(low_grads[key].grad, p.grad, largest)]
    return result


if __name__ == "__main__":
    print(json.dumps(main_(*sys.argv[1:4])))
