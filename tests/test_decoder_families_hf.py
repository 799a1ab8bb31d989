"""``replace_decoder_layers``: the decoder layers of HF's Llama-family models of other classes
replaced by the tuned layer of their family's spec (the main job's artifact at the spec's dims, the
cost model's plan): Qwen2 / Qwen2.5 (``configs/qwen2.py``: biases on Q, K and V), Qwen3
(``configs/qwen3.py``: RMSNorm of every query and key head) and Mistral (``configs/llama.py``,
Llama's layer).  On the CPU (the torch backend) against HF's model untouched, in float32 and
float64: the output at every unpadded position and the gradient of every parameter (the layers'
through ``WEIGHTS``, the embedding's: the layers' input gradient), unpadded, left-padded and padded
to the tuned length, under HF's activation checkpointing too; sliding windows covering the sequence
are taken; a model of another family, a window shorter than the sequence and a config the spec
does not compute are refused in one line."""
import importlib
import warnings

import numpy as np
import pytest
import torch

from datamove.hf import replace_decoder_layers, replace_llama_layers
from hf_models import check_against_hf, check_decoder_layer_against_executor, check_padded, replaced_pair

transformers = pytest.importorskip("transformers")
TOLERANCE = 2e-5  # float32 against float32, relative to the largest value: measured up to 2e-6
FLOAT64_TOLERANCE = 1e-6  # float64 against HF's float64 model, whose RMSNorms compute in float32: measured up to 5e-7
SIZES = dict(vocab_size=50, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
             num_hidden_layers=2, max_position_embeddings=64)  # the specs' default dims: D=64 H=4 KV=2 E=16 F=128
FAMILIES = {  # model class, config class, the config at the spec's values, the artifact's fixture
    "qwen2": ("Qwen2Model", "Qwen2Config", dict(rms_norm_eps=1e-6), "qwen2_artifact"),
    "qwen3": ("Qwen3Model", "Qwen3Config", dict(head_dim=16, rms_norm_eps=1e-6), "qwen3_artifact"),
    "mistral": ("MistralModel", "MistralConfig", dict(head_dim=16, rms_norm_eps=1e-5), "llama_artifact"),
}
# windows covering the tuned length (16): Qwen2's on its second layer (max_window_layers=1, HF's
# sliding-window mask for it), Qwen3's exactly 16, Mistral's default 4096
WINDOWS = {"qwen2": dict(use_sliding_window=True, sliding_window=64, max_window_layers=1),
           "qwen3": dict(use_sliding_window=True, sliding_window=16, max_window_layers=0),
           "mistral": dict(sliding_window=4096)}


def model_of(family: str, **changes) -> torch.nn.Module:
    """A HF model of ``family`` at the spec's sizes and values with ``changes``, eager attention."""
    model_class, config_class, own, _ = FAMILIES[family]
    config = getattr(transformers, config_class)(**{**SIZES, **own, **changes})
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    return getattr(transformers, model_class)(config)


def artifact_of(request, family: str):
    return request.getfixturevalue(FAMILIES[family][3])


@pytest.mark.parametrize("padded", [False, True], ids=["unpadded", "left-padded"])
@pytest.mark.parametrize("family", FAMILIES)
def test_a_replaced_model_trains_as_hf(request, family, padded):
    """float32, a sliding window covering the sequence in the config (HF asks for its sliding-window
    mask, the causal one then: it was refused as 'another attention mask')."""
    model = model_of(family, **WINDOWS[family])
    reference, ours = replaced_pair(model, replace_decoder_layers, artifact_of(request, family), 2, 0.1)
    assert {type(m).__name__ for m in ours.layers} == {"LlamaLayerReplacement"}
    ids = torch.randint(0, 50, (2, 16), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(2, 16, dtype=torch.long)
    if padded:
        mask[1, :5] = 0
    check_against_hf(reference, ours, ids, mask, TOLERANCE)


@pytest.mark.parametrize("family", FAMILIES)
def test_in_float64_padded_to_the_tuned_length_and_checkpointed(request, family):
    """float64 (no window), batches of shorter sequences padded on the right to the tuned length or
    to their longest (a length of its own: the rotary tables' leading rows), each sequence as HF's
    model computes it alone; under HF's activation checkpointing; the replaced
    model's state dict is HF's (its keys, its values)."""
    reference, ours = replaced_pair(model_of(family, sliding_window=None).double(), replace_decoder_layers,
                                    artifact_of(request, family), 2, 0.1, dtype=torch.float64)
    ours.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    state, expected = ours.state_dict(), reference.state_dict()
    assert sorted(state) == sorted(expected) and all(torch.equal(state[k], expected[k]) for k in expected)
    check_padded(reference, ours, [11, 1, 16], 16, 50, FLOAT64_TOLERANCE)
    check_padded(reference, ours, [11, 4], 11, 50, FLOAT64_TOLERANCE)  # padded to its longest, shorter than T


@pytest.mark.parametrize("rope", [
    dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=8, rope_theta=10000.0),
    dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8,
         rope_theta=500000.0)], ids=["yarn", "llama3"])
def test_scaled_rotary_tables_compute_as_hf(qwen3_artifact, rope):
    """The rotary tables are the model's, whatever its rope_parameters: YaRN's (scaled by its
    attention factor) and Llama-3's, float32, left-padded."""
    reference, ours = replaced_pair(model_of("qwen3", rope_parameters=rope), replace_decoder_layers, qwen3_artifact, 2,
                                    0.1)
    ids = torch.randint(0, 50, (2, 16), generator=torch.Generator().manual_seed(3))
    mask = torch.ones(2, 16, dtype=torch.long)
    mask[0, :3] = 0
    check_against_hf(reference, ours, ids, mask, TOLERANCE)


def test_replace_llama_layers_is_replace_decoder_layers(llama_artifact):
    """Its first name takes the family too: a Mistral model's layers with configs/llama.py's artifact."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert replace_llama_layers(model_of("mistral"), llama_artifact, dtype=torch.float32, allow_mismatch=True) == 2


def refused(replace, model, artifact, match: str) -> None:
    """``replace(model, artifact)`` refused in one line matching ``match``, nothing replaced."""
    kinds = [type(layer).__name__ for layer in model.layers]
    with pytest.raises(ValueError, match=match) as caught, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        replace(model, artifact, dtype=torch.float32, allow_mismatch=True)
    assert "\n" not in str(caught.value)
    assert [type(layer).__name__ for layer in model.layers] == kinds


@pytest.mark.parametrize("family, artifact, refusal", [
    ("qwen3", "qwen2_artifact", r"no Qwen2DecoderLayer in the model to replace \(its layers: Qwen3DecoderLayer\); the "
                                r"tuned layer stands in for HF's Qwen2DecoderLayer only: tune the spec of the model's "
                                r"family \(configs/qwen3.py for a Qwen3DecoderLayer\) with optimize-layer"),
    ("qwen2", "llama_artifact", r"no LlamaDecoderLayer or MistralDecoderLayer in the model .*\(configs/qwen2.py for a "
                                r"Qwen2DecoderLayer\)"),
    ("mistral", "qwen3_artifact", r"no Qwen3DecoderLayer .*\(configs/llama.py for a MistralDecoderLayer\)"),
    ("qwen2", "gpt2_artifact", r"stands in for no HF decoder layer \(its spec's WEIGHTS name GPT2Block\): tune a "
                               r"Llama-family spec \(configs/llama.py, configs/qwen2.py, configs/qwen3.py\), or use "
                               r"replace_bert_layers / replace_gpt2_blocks"),
])
def test_an_artifact_of_another_family_is_refused(request, family, artifact, refusal):
    """Qwen2's and Qwen3's layers take the same weights' shapes but compute otherwise (biases, head
    norms): the artifact's WEIGHTS name the classes it computes, and a model of another is refused."""
    refused(replace_decoder_layers, model_of(family), request.getfixturevalue(artifact), refusal)


@pytest.mark.parametrize("family, changes, refusal", [
    ("mistral", dict(sliding_window=15), r"sliding_window=15 \(the tuned layer computes None or at least 16\)"),
    ("qwen2", dict(use_sliding_window=True, sliding_window=8, max_window_layers=0),
     r"sliding_window=8 \(the tuned layer computes None or at least 16\)"),
    ("qwen2", dict(rms_norm_eps=1e-5), r"rms_norm_eps=1e-05 \(the tuned layer computes 1e-06\)"),
    ("qwen2", dict(hidden_act="gelu"), r"hidden_act='gelu' \(the tuned layer computes \['silu', 'swish'\]\)"),
    ("qwen3", dict(attention_bias=True), r"attention_bias=True \(the tuned layer computes False\)"),
    ("qwen3", dict(num_attention_heads=2, num_key_value_heads=1, head_dim=32),  # the same weights' shapes
     r"num_attention_heads=2 \(the tuned layer computes 4\); num_key_value_heads=1 \(the tuned layer computes 2\); "
     r"head_dim=32 \(the tuned layer computes 16\)"),
    ("mistral", dict(attention_dropout=0.1), r"attention_dropout=0.1 \(the tuned layer computes 0.0\)"),
], ids=["mistral-window", "qwen2-window", "qwen2-eps", "qwen2-act", "qwen3-bias", "qwen3-heads", "mistral-dropout"])
def test_a_model_configured_otherwise_than_the_spec_is_refused(request, family, changes, refusal):
    """The spec's HF_CONFIG: a sliding window shorter than the tuned length (the layer attends over
    every position before), another epsilon, activation, biases, head counts or attention dropout."""
    refused(replace_decoder_layers, model_of(family, **changes), artifact_of(request, family),
            "datamove: the model's config asks for what the tuned layer does not compute: " + refusal)


def test_a_window_shorter_than_the_sequence_at_the_call_is_refused(llama_artifact):
    """The window is checked against the sequence again at every call (a config changed after the
    replacement): HF's sliding-window mask reaches the layers only where it covers every key, which
    the layers' causal mask then is."""
    _, ours = replaced_pair(model_of("mistral", sliding_window=16), replace_decoder_layers, llama_artifact, 2, 0.1)
    ids = torch.randint(0, 50, (2, 16), generator=torch.Generator().manual_seed(4))
    ours(input_ids=ids, attention_mask=torch.ones_like(ids))
    ours.config.sliding_window = 12
    with pytest.raises(ValueError, match=r"the model's sliding window \(12 positions\) is shorter than the sequence "
                                         r"\(16\), and the replaced decoder layers attend over every position before"):
        ours(input_ids=ids, attention_mask=torch.ones_like(ids))


ODD = dict(B=3, T=7, D=18, H=6, KV=2, E=6, F=22)  # 3 query heads per K/V head; E even (HF's rotary halves)


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_the_spec_computes_as_hfs_layer_and_analyses(family, tmp_path, capsys):
    """The spec's training graph (the reference executor, float64) against HF's decoder layer
    (eager, float64, weights drawn N(0, 0.3) through the spec's WEIGHTS) at odd sizes: the output,
    the input's gradient and every parameter's, to HF's float32 RMSNorm; and ``--analyze``."""
    from datamove.cli import main
    from datamove.dataflow.pipeline import analyse_spec
    from datamove.dataflow.spec import load_spec

    spec = f"configs/{family}.py"
    analysis = analyse_spec(spec, ODD)
    model_class, config_class, own, _ = FAMILIES[family]
    config = getattr(transformers, config_class)(**{**own, **dict(
        hidden_size=ODD["D"], intermediate_size=ODD["F"], num_attention_heads=ODD["H"], num_key_value_heads=ODD["KV"],
        head_dim=ODD["E"])})
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    modeling = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    hf = getattr(modeling, f"{family.capitalize()}DecoderLayer")(config, layer_idx=0).double()
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0.0, 0.3)
    rng = np.random.default_rng(13)
    x = torch.tensor(rng.standard_normal((ODD["B"], ODD["T"], ODD["D"])), requires_grad=True)
    table = load_spec(spec).function.__globals__["WEIGHTS"][f"transformers.{type(hf).__name__}"]
    tables = getattr(transformers, model_class)(config).rotary_emb(x, torch.arange(ODD["T"])[None])
    check_decoder_layer_against_executor(hf, table, analysis, x, tables, rng)

    assert main([spec, "--analyze", "--dims", ",".join(f"{k}={v}" for k, v in ODD.items())]) == 0
    text = capsys.readouterr().out
    assert "contraction" in text and "normalization" in text and "reduction" in text


@pytest.mark.skipif(torch.cuda.is_available(), reason="float32 through the Triton interpreter (CPU)")
@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_the_plans_kernels_compute_as_the_executor(request, family):
    """The artifact's generated kernels (the biases' and the head norms' epilogues and maps among
    them) through the Triton interpreter, float32, against the float64 executor: y, d_x and every
    weight's gradient, with random rotary tables."""
    from test_export import check_against_executor, load, randomize
    from test_llama_gqa import set_constants

    layer = load(artifact_of(request, family), backend="kernels", allow_mismatch=True)
    randomize(layer, 1)
    set_constants(layer)
    check_against_executor(layer, {"x": None})
