"""``replace_llama_layers``: a HF ``LlamaModel``'s decoder layers replaced by the tuned layer of
``configs/llama.py`` (the main job's artifact at the spec's dims), on the CPU (the torch backend),
against the model untouched in float32: the output at every unpadded position and the gradient of
every parameter (the layers' through ``WEIGHTS``), without padding and with left padding (keys
before the sequence excluded); the rotary tables reach the layers from the model; what the layer
cannot do is refused in one line."""
import contextlib
import copy
import warnings

import pytest
import torch

from datamove.hf import replace_llama_layers
from datamove.runtime.module import TunedLayer
from hf_models import check_against_hf, check_padded, hf_named_grads, replaced_pair
from process_group import one_process_group

transformers = pytest.importorskip("transformers")
TOLERANCE = 2e-5  # float32 against float32, relative to the largest value: measured ~2e-7
FLOAT64_TOLERANCE = 1e-6  # float64 against HF's float64 model, whose RMSNorm computes in float32: measured ~1e-7


def small_config(**changes):
    return transformers.LlamaConfig(**{**dict(vocab_size=50, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                                              head_dim=16, intermediate_size=128, num_hidden_layers=2, rms_norm_eps=1e-5,
                                              max_position_embeddings=64), **changes})


def models(llama_artifact, **changes):
    config = small_config(**changes)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    return replaced_pair(transformers.LlamaModel(config), replace_llama_layers, llama_artifact, 2, 0.1)


@pytest.mark.parametrize("padded", [False, True], ids=["unpadded", "left-padded"])
def test_a_replaced_llama_model_trains_as_hf(llama_artifact, padded):
    reference, ours = models(llama_artifact)
    ids = torch.randint(0, 50, (2, 16), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(2, 16, dtype=torch.long)
    if padded:
        mask[1, :5] = 0
    check_against_hf(reference, ours, ids, mask, TOLERANCE)


def two_forwards_one_backward(model, ids: torch.Tensor, positions: torch.Tensor | None, weights: torch.Tensor):
    """``model`` on ``ids[0]`` at positions 0..15, then on ``ids[1]`` at ``positions`` (None: 0..15
    again), then one backward of a loss of both outputs (``weights``: [2, batch, 16, 64]): the outputs."""
    mask = torch.ones_like(ids[0])
    a = model(input_ids=ids[0], attention_mask=mask).last_hidden_state
    b = model(input_ids=ids[1], attention_mask=mask, position_ids=positions).last_hidden_state
    ((a.square() * weights[0]).sum() + (a * b * weights[1]).sum()).backward()
    return a.detach(), b.detach()


@pytest.mark.parametrize("second, how", [("other positions", "plain"), ("the same positions", "plain"),
                                         ("other positions", "checkpointed"), ("other positions", "reentrant"),
                                         ("other positions", "compiled"), ("other positions", "fsdp2")])
def test_two_forwards_before_one_backward_train_as_hf(llama_artifact, tmp_path, second, how):
    """DPO and contrastive losses run the model twice before one backward: each call's rotary tables
    go into new memory (``set_constant``), so the first call's backward computes with its own (they
    were copied into the layers' constants in place: autograd's in-place check failed the
    backward, plainly, compiled and under FSDP2; under activation checkpointing the first call's
    recomputation read the second call's tables, its gradients silently wrong).  The second call at
    other positions (with gaps: a mere shift rotary attention would not tell apart) or the same
    ones (new tables of equal values); against HF in float64, batch 3 (the plan's is 2): outputs
    and every gradient."""
    reference, ours = replaced_pair(transformers.LlamaModel(small_config(_attn_implementation="eager")).double(),
                                    replace_llama_layers, llama_artifact, 2, 0.1, dtype=torch.float64)
    gen = torch.Generator().manual_seed(11)
    ids = torch.randint(0, 50, (2, 3, 16), generator=gen)
    weights = torch.randn(2, 3, 16, 64, generator=gen, dtype=torch.float64)
    positions = torch.arange(16)[None] * 3 + 1 if second == "other positions" else None
    if how in ("checkpointed", "reentrant"):
        ours.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": how == "reentrant"})
    expected = two_forwards_one_backward(reference, ids, positions, weights)
    run = ours
    with contextlib.ExitStack() as stack:
        if how == "compiled":
            torch._dynamo.reset()
            stack.callback(torch._dynamo.reset)  # what dynamo traced of this model stays out of later tests' compiles
            run = torch.compile(ours, backend="eager")
        if how == "fsdp2":
            from torch.distributed.fsdp import fully_shard

            stack.enter_context(one_process_group(tmp_path, "gloo"))
            for block in ours.layers:
                fully_shard(block)
            fully_shard(ours)
        outputs = two_forwards_one_backward(run, ids, positions, weights)
        grads = hf_named_grads(ours)
    for y, want in zip(outputs, expected):
        assert float((y - want).abs().max()) < FLOAT64_TOLERANCE * float(want.abs().max())
    reference_params = dict(reference.named_parameters())
    assert set(grads) == set(reference_params)
    for name, p in reference_params.items():
        assert float((grads[name] - p.grad).abs().max()) < FLOAT64_TOLERANCE * float(p.grad.abs().max()), name


def test_a_replaced_model_called_with_its_cache_is_saved_whole_and_trains_as_hf(llama_artifact, tmp_path):
    """``torch.save`` of the whole replaced model (a training checkpoint) after a call in which HF made
    its key-value cache (``use_cache``, the models' default) failed with "cannot pickle
    'weakref.ReferenceType' object": each replacement kept that cache weakly (to refuse generation's
    second step).  Loaded, it computes as HF's model in float64, a batch padded to its longest
    sequence, shorter than the tuned 16 (output, every gradient); generation is still refused."""
    reference, ours = replaced_pair(transformers.LlamaForCausalLM(small_config(_attn_implementation="eager")).double(),
                                    replace_llama_layers, llama_artifact, 2, 0.1, dtype=torch.float64)
    ids = torch.randint(0, 50, (3, 11), generator=torch.Generator().manual_seed(12))
    ours(input_ids=ids, attention_mask=torch.ones_like(ids))
    torch.save(ours, tmp_path / "model.pt")
    loaded = torch.load(tmp_path / "model.pt", weights_only=False)
    check_padded(reference.model, loaded.model, [11, 4, 7], 11, 50, FLOAT64_TOLERANCE)
    with pytest.raises(ValueError, match="generation with a key-value cache is not part of the tuned layer"):
        loaded.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=2, do_sample=False)


def test_a_model_naming_silu_swish_is_replaced_and_trains_as_hf(llama_artifact):
    """hidden_act="swish" is HF's SiLU under its other name (ACT2FN): such a model was refused as
    configured otherwise than the spec."""
    reference, ours = models(llama_artifact, hidden_act="swish")
    ids = torch.randint(0, 50, (2, 16), generator=torch.Generator().manual_seed(8))
    check_against_hf(reference, ours, ids, torch.ones(2, 16, dtype=torch.long), TOLERANCE)


def test_a_replaced_model_runs_under_inference_mode_and_trains_after(llama_artifact):
    """Under ``torch.inference_mode`` the rotary tables and the padding mask are inference tensors,
    which have no version counter (the replacements' caches of them failed with 'Inference tensors
    do not track version counter'): computed as HF, and a training step afterwards too."""
    reference, ours = models(llama_artifact)
    ids = torch.randint(0, 50, (2, 16), generator=torch.Generator().manual_seed(9))
    mask = torch.ones(2, 16, dtype=torch.long)
    mask[0, :6] = 0
    keep = mask.bool()
    for _ in range(2):  # the same tables and mask again: nothing kept from the call before
        with torch.inference_mode():
            expected = reference(input_ids=ids, attention_mask=mask).last_hidden_state
            y = ours(input_ids=ids, attention_mask=mask).last_hidden_state
        assert float((y - expected)[keep].abs().max()) < TOLERANCE * float(expected[keep].abs().max())
    check_against_hf(reference, ours, ids, mask, TOLERANCE)


def test_a_replaced_model_gives_hfs_hidden_states_and_refuses_attention_weights(llama_artifact):
    """``output_hidden_states``: every layer's input and output as HF's own layers give them, all or
    those selected by index (they came back empty: HF's hooks collect them from the layer classes the
    model names); ``output_attentions``: refused, the fused attention forms no weights."""
    reference, ours = models(llama_artifact)
    ids = torch.randint(0, 50, (2, 16), generator=torch.Generator().manual_seed(2))
    for asked in (True, [0, -1]):
        expected = reference(input_ids=ids, output_hidden_states=asked).hidden_states
        got = ours(input_ids=ids, output_hidden_states=asked).hidden_states
        assert len(got) == len(expected) == 3
        for state, wanted in zip(got, expected):
            assert (state is None) == (wanted is None)
            if wanted is not None:
                assert float((state - wanted).abs().max()) < TOLERANCE * float(wanted.abs().max())
    with pytest.raises(ValueError, match="output_attentions=True: the tuned layer's fused attention forms no attention weights"):
        ours(input_ids=ids, output_attentions=True)


def test_for_a_model_loop_taking_tuples_the_replacement_returns_one(llama_artifact):
    """transformers before 4.54 (no ``_can_record_outputs``): the model loop takes the first of a
    layer's outputs and asks it for attention weights with ``output_attentions``."""
    from datamove.hf import LlamaLayerReplacement

    _, ours = models(llama_artifact)
    layer = ours.layers[0]
    old = LlamaLayerReplacement(layer.layer, returns_tuple=True)
    x = torch.randn(2, 16, 64)
    tables = ours.rotary_emb(x, torch.arange(16)[None])
    (y,) = old(x, position_embeddings=tables)
    assert torch.equal(y, layer(x, position_embeddings=tables))
    with pytest.raises(ValueError, match="output_attentions=True"):
        old(x, position_embeddings=tables, output_attentions=True)


def test_what_the_layer_cannot_do_is_refused(llama_artifact):
    _, ours = models(llama_artifact)
    layer = ours.layers[0]
    x = torch.randn(2, 16, 64)
    cos, sin = ours.rotary_emb(x, torch.arange(16)[None])
    with pytest.raises(ValueError, match="needs the model's position_embeddings"):
        layer(x)
    longer = torch.randn(2, 20, 64)
    with pytest.raises(ValueError, match=r"is \(20, 16\) .*the tuned layer's is \(16, 16\): the layer's tables hold "
                                         r"positions 0..15: truncate every batch to 16"):
        layer(longer, position_embeddings=ours.rotary_emb(longer, torch.arange(20)[None]))
    with pytest.raises(ValueError, match=r"is \(16, 8\) .*: the model's rotary head dim is not the spec's"):
        layer(x, position_embeddings=(cos[..., :8], sin[..., :8]))  # it said: call the model at the tuned sequence length
    shifted = ours.rotary_emb(x, torch.stack([torch.arange(16), torch.arange(16) + 3]))
    with pytest.raises(ValueError, match="differ between the sequences of the batch"):
        layer(x, position_embeddings=shifted)
    assert ours.config.use_cache  # left as it was: a checkpoint saved from the model keeps it
    ids = torch.randint(0, 50, (2, 16))
    made = ours(input_ids=ids, use_cache=True).past_key_values  # the layers fill none: it stays empty
    assert made is None or made.get_seq_length() == 0
    causal_lm = transformers.LlamaForCausalLM(small_config())
    replace_llama_layers(causal_lm, llama_artifact, dtype=torch.float32, allow_mismatch=True)
    # its second step: one token with the (empty) cache of the first (which ran: 16 tokens), or 17 without one
    for use_cache, refusal in ((True, "generation with a key-value cache is not part of the tuned layer"),
                               (False, r"hold positions 0..15: .*generation, model.generate, is not part of the tuned")):
        with pytest.raises(ValueError, match=refusal):
            causal_lm.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=2, do_sample=False,
                               use_cache=use_cache)
    with pytest.raises(ValueError, match=r"set_constant\('cos'\): a tensor of shape \(17, 16\); cos is over s, e: "
                                         r"\(16, 16\) \(a position table: or fewer positions along s, the leading ones\)"):
        layer.layer.set_constant("cos", torch.zeros(17, 16))
    table = cos[0].clone()
    table[3, 5] = float("nan")  # NaN marks a constant not set: never taken as a value
    with pytest.raises(ValueError, match=r"set_constant\('cos'\): the values hold NaN \(at \(3, 5\) over s, e\)"):
        layer.layer.set_constant("cos", table)


def test_batches_of_any_length_up_to_the_tuned_one_train_as_hf(llama_artifact):
    """The rotary tables are position tables (``configs/llama.py``'s ``POSITION_TABLES``): a batch
    shorter than the tuned T=16 (odd, 1), padded on the right to its longest sequence as a collator
    pads it, unpadded or left-padded, computes as HF's model given the same, output and every
    gradient, and each sequence as HF's on it alone; the layers read the leading rows of the tables
    HF gives them (they were refused: pad every batch to 16).  A longer batch is refused: the
    tables hold positions 0..15."""
    reference, ours = models(llama_artifact)
    for lengths in ([11, 1, 7], [1], [9, 9], [13, 16]):
        check_padded(reference, ours, lengths, max(lengths), 50, TOLERANCE)
    check_padded(reference, ours, [7], 16, 50, TOLERANCE)  # padded to T, as the refusal said: still so
    ids = torch.randint(0, 50, (2, 9), generator=torch.Generator().manual_seed(4))
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[0, :4] = 0
    check_against_hf(reference, ours, ids, mask, TOLERANCE)
    with pytest.raises(ValueError, match=r"the layer's tables hold positions 0..15: truncate every batch to 16, or tune "
                                         r"the layer at your longest length \(optimize-layer --dims T=...\), which runs "
                                         r"every shorter batch"):
        ours(input_ids=torch.randint(0, 50, (2, 19)))


def test_generation_without_a_cache_is_hfs_and_with_one_refused(llama_artifact):
    """Without a cache each step of ``generate`` runs the whole sequence again, a call of its length:
    the tokens are HF's (up to 16 in all); with a cache, the second step (one token, the cache the
    layers left empty) would compute the token alone, wrongly, and is refused."""
    config = small_config()
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    reference, ours = replaced_pair(transformers.LlamaForCausalLM(config), replace_llama_layers, llama_artifact, 2, 0.1)
    ids = torch.randint(0, 50, (2, 5), generator=torch.Generator().manual_seed(6))
    asked = dict(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False)
    assert torch.equal(ours.generate(**asked, use_cache=False), reference.generate(**asked, use_cache=False))
    with pytest.raises(ValueError, match="generation with a key-value cache is not part of the tuned layer"):
        ours.generate(**asked, use_cache=True)


def test_rotary_tables_set_from_numpy_compute_as_hf(llama_artifact):
    """``set_constant`` takes the tables as NumPy arrays (it failed with AttributeError: no isnan):
    the tuned layer with HF's tables set so computes as HF's decoder layer under its causal mask."""
    reference, ours = models(llama_artifact)
    x = torch.randn(2, 16, 64, generator=torch.Generator().manual_seed(7))
    cos, sin = reference.rotary_emb(x, torch.arange(16)[None])
    layer = ours.layers[0].layer
    layer.set_constant("cos", cos[0].numpy())
    layer.set_constant("sin", sin[0].numpy())
    causal = torch.triu(torch.full((16, 16), float("-inf")), 1)[None, None]
    with torch.no_grad():
        expected = reference.layers[0](x, attention_mask=causal, position_embeddings=(cos, sin))
        y = layer(x)
    expected = expected[0] if isinstance(expected, tuple) else expected
    assert float((y - expected).abs().max()) < TOLERANCE * float(expected.abs().max())


@pytest.mark.parametrize("changes, refusal", [
    (dict(rms_norm_eps=1e-2), r"rms_norm_eps=0.01 \(the tuned layer computes 1e-05\)"),
    (dict(hidden_act="gelu"), r"hidden_act='gelu' \(the tuned layer computes \['silu', 'swish'\]\)"),
    (dict(attention_dropout=0.1), r"attention_dropout=0.1 \(the tuned layer computes 0.0\)"),
    (dict(attention_bias=True), r"attention_bias=True"),
    (dict(num_attention_heads=2, num_key_value_heads=1, head_dim=32),  # the same weights' shapes
     r"num_attention_heads=2 \(the tuned layer computes 4\); num_key_value_heads=1 \(the tuned layer computes 2\); "
     r"head_dim=32 \(the tuned layer computes 16\)"),
    (dict(intermediate_size=96),  # it said which shape, not which weight nor what to do
     r"mlp.gate_proj.weight: weight of shape \(96, 64\) does not match 'f d' = \(128, 64\): the module is of other "
     r"sizes than the tuned layer; run optimize-layer with --dims"),
], ids=["eps", "act", "dropout", "bias", "heads", "sizes"])
def test_a_model_configured_otherwise_than_the_spec_is_refused(llama_artifact, changes, refusal):
    """A model whose config asks for another RMSNorm epsilon, activation, attention dropout or biases
    than the spec computes (its HF_CONFIG) is refused whole: the layers would have run with the
    spec's values without a word (found by configuring HF models as users do)."""
    model = transformers.LlamaModel(small_config(**changes))
    with pytest.raises(ValueError, match=refusal), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        replace_llama_layers(model, llama_artifact, dtype=torch.float32, allow_mismatch=True)
    assert type(model.layers[0]).__name__ == "LlamaDecoderLayer"  # nothing replaced


def test_a_spec_without_hf_config_warns_that_the_models_config_goes_unchecked(tmp_path, capsys):
    """A Llama spec without HF_CONFIG (a user's own copy of configs/llama.py, say) checks no config:
    a model with another RMSNorm epsilon was replaced without a word and computed otherwise than
    HF's (found probing as a user); it is now warned, and the difference is real."""
    from datamove.cli import main

    source = open("configs/llama.py").read()
    spec = tmp_path / "llama_own.py"
    spec.write_text(source[:source.index("def HF_CONFIG")] + source[source.index("# Where each parameter"):])
    assert main([str(spec), "--out", str(tmp_path / "out")]) == 0
    capsys.readouterr()
    config = small_config(rms_norm_eps=1e-2)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    reference = transformers.LlamaModel(config)
    ours = copy.deepcopy(reference)
    with pytest.warns(UserWarning, match="declares no HF_CONFIG, so the model's config .* is not checked"):
        replace_llama_layers(ours, tmp_path / "out", dtype=torch.float32, allow_mismatch=True)
    ids = torch.randint(0, 50, (2, 16), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        expected = reference(input_ids=ids).last_hidden_state
        y = ours(input_ids=ids).last_hidden_state
    assert float((y - expected).abs().max()) > 100 * TOLERANCE * float(expected.abs().max())  # what the warning is about


def test_rotary_tables_declared_with_a_gradient_are_named_in_the_refusal(tmp_path, capsys):
    """A Llama spec whose cos and sin lack requires_grad=False (data inputs then, holding the
    sequence letter) has no tables the model can set: its POSITION_TABLES are refused by the job,
    and without them the replacement is refused saying how to declare them (it said 'not a Llama
    spec's layer')."""
    from datamove.cli import main

    spec = tmp_path / "llama_graded.py"
    graded = open("configs/llama.py").read().replace(', requires_grad=False)', ')')
    spec.write_text(graded)
    assert main([str(spec), "--out", str(tmp_path / "out")]) == 2  # its POSITION_TABLES name data inputs
    assert capsys.readouterr().err.strip().endswith("POSITION_TABLES names 'cos': it has a gradient (declare it "
                                                    "Tensor(..., requires_grad=False)); it names constants whose values "
                                                    "the caller sets (the layer's: [])")
    spec.write_text(graded.replace('POSITION_TABLES = ("cos", "sin")', ''))
    assert main([str(spec), "--out", str(tmp_path / "out")]) == 0
    capsys.readouterr()
    model = transformers.LlamaModel(small_config())
    with pytest.raises(ValueError, match=r"no constant\(s\) cos, sin .*: its spec gives cos, sin a gradient: declare them "
                                         r"as configs/llama.py does, Tensor\(\"se\", requires_grad=False\)"), \
            warnings.catch_warnings():
        warnings.simplefilter("ignore")
        replace_llama_layers(model, tmp_path / "out", dtype=torch.float32, allow_mismatch=True)
    assert type(model.layers[0]).__name__ == "LlamaDecoderLayer"


def test_biases_the_spec_does_not_read_are_refused_and_a_model_without_llama_layers_too(llama_artifact):
    """load_weights refuses a module's parameters its spec's WEIGHTS do not place (the biases of a
    layer configured with them; they were dropped without a word); a model with no
    LlamaDecoderLayer (Qwen2's) is refused instead of left as it was with 0 replaced."""
    from datamove.export import load_layer, load_weights

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        layer = load_layer(llama_artifact, dtype=torch.float32, allow_mismatch=True)
    biased = transformers.LlamaModel(small_config(mlp_bias=True)).layers[0]
    with pytest.raises(ValueError, match=r"parameter\(s\) mlp.down_proj.bias, mlp.gate_proj.bias, mlp.up_proj.bias "
                                         "have no place in the spec"):
        load_weights(layer, biased)
    qwen = transformers.Qwen2Model(transformers.Qwen2Config(vocab_size=50, hidden_size=64, num_attention_heads=4,
                                                            num_key_value_heads=2, intermediate_size=128,
                                                            num_hidden_layers=1))
    with pytest.raises(ValueError, match=r"no LlamaDecoderLayer or MistralDecoderLayer in the model to replace \(its "
                                         r"layers: .*Qwen2DecoderLayer.*: tune the spec of the model's family \(configs/qwen2.py"):
        replace_llama_layers(qwen, llama_artifact, dtype=torch.float32, allow_mismatch=True)


def test_the_models_tables_are_set_without_a_check_per_call(llama_artifact, monkeypatch):
    """The rotary tables copied in on every model call are taken as set (the NaN check of a
    constant the caller sets waits for a GPU), and only constants without a value of their own
    may be set so."""
    _, ours = models(llama_artifact)
    layer = ours.layers[0].layer
    looked = []
    real, holds = torch.Tensor.isnan, TunedLayer._holds_its_value
    monkeypatch.setattr(torch.Tensor, "isnan", lambda self: looked.append(tuple(self.shape)) or real(self))
    monkeypatch.setattr(TunedLayer, "_holds_its_value",
                        lambda self, name, value: looked.append(name) or holds(self, name, value))
    ours(input_ids=torch.randint(0, 50, (2, 16)))  # the first call checks each constant once
    assert looked
    looked.clear()
    ours(input_ids=torch.randint(0, 50, (2, 16)))  # new tables from the model, copied in: nothing checked again
    assert looked == []
    with pytest.raises(ValueError, match="causal: not a constant of the layer that the caller sets"):
        layer.set_constant("causal", torch.zeros(16, 16))


def test_a_replaced_model_loads_a_state_dict_of_its_tuned_layers(llama_artifact):
    """A state dict holding the tuned layers' own entries (``layer.<name>`` and the layouts in their
    extra state, a uint8 JSON tensor, or a dict as saved before) loads into a model replaced alike,
    exactly (checkpoints written before the replaced model's state dict was HF's)."""
    _, ours = models(llama_artifact)
    _, again = models(llama_artifact)
    with torch.no_grad():
        for p in again.parameters():
            p.add_(1.0)
    own = {f"layers.{n}.layer.{k}": v for n, block in enumerate(ours.layers) for k, v in block.layer.state_dict().items()}
    again.load_state_dict({**{k: v for k, v in ours.state_dict().items() if not k.startswith("layers.")}, **own})
    for n in range(2):
        for name in ours.layers[n].layer.interface.parameters:
            assert torch.equal(again.layers[n].layer.spec_view(name), ours.layers[n].layer.spec_view(name)), name
    layer = again.layers[0].layer
    old = {k.removeprefix("layers.0.layer."): v for k, v in own.items() if k.startswith("layers.0.layer.")}
    old["_extra_state"] = {"layouts": {t: layer.plan.layouts[t] for t in layer._spec_axes}}
    layer.load_state_dict(old)
    assert torch.equal(layer.spec_view("wq"), ours.layers[0].layer.spec_view("wq"))


def test_a_compiled_replaced_model_needs_an_attention_mask_and_then_matches_hf(llama_artifact):
    """Under torch.compile, without a cache, HF asks for a causal mask combined with its
    packed-sequence check when the model gets no attention_mask (it cannot read position_ids
    there): refused with the way out (it said the model asked for a bidirectional or sliding-window
    mask); with the mask, or with the model's (empty) cache, as HF."""
    reference, ours = models(llama_artifact)
    torch._dynamo.reset()
    compiled = torch.compile(ours, backend="eager")
    ids = torch.randint(0, 50, (2, 16), generator=torch.Generator().manual_seed(3))
    with pytest.raises(ValueError, match=r"call the model with attention_mask=torch.ones_like\(input_ids\)"):
        compiled(input_ids=ids, use_cache=False)
    mask = torch.ones_like(ids)
    expected = reference(input_ids=ids, attention_mask=mask).last_hidden_state
    for y in (compiled(input_ids=ids, attention_mask=mask, use_cache=False).last_hidden_state,
              compiled(input_ids=ids).last_hidden_state):
        assert float((y - expected).abs().max() / expected.abs().max()) < TOLERANCE
    torch._dynamo.reset()  # what dynamo traced of this model stays out of later tests' compiles


def test_padding_with_a_plan_without_the_fused_attention_says_why(tmp_path, capsys):
    """At a head dim the fused kernels do not take (12) the plan runs the attention unfused, which
    applies no key-padding mask: a padded call is refused naming that reason and what to do."""
    from datamove.cli import main
    from datamove.export import load_layer

    out = tmp_path / "e12"
    assert main(["configs/llama.py", "--dims", "B=2,T=12,D=48,H=4,KV=2,E=12,F=40", "--out", str(out)]) == 0
    capsys.readouterr()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        layer = load_layer(out, dtype=torch.float32, allow_mismatch=True)
    for name in ("cos", "sin"):
        layer.set_constant(name, torch.rand(12, 12))
    mask = torch.zeros(2, 12, dtype=torch.bool)
    mask[1, :3] = True
    with pytest.raises(ValueError, match=r"runs no fused attention to apply it \(head dims \[12\].*\); pad no batch"):
        layer(torch.randn(2, 12, 48), key_padding_mask=mask)


def test_a_replaced_models_state_dict_is_hfs_checkpoint(llama_artifact, tmp_path):
    """A replaced model's ``state_dict`` / ``save_pretrained`` hold HF's keys and layouts: a HF model
    made ``from_pretrained`` on them computes as the replaced one (its decoder layers came back newly
    initialised, the checkpoint holding the tuned layers' names); a HF state dict loads into a
    replaced model, strictly."""
    reference, ours = models(llama_artifact)
    with torch.no_grad():
        for p in ours.parameters():
            p.add_(0.01)  # trained, say: the checkpoint is the replaced model's, not the reference's
    state = ours.state_dict()
    assert sorted(state) == sorted(reference.state_dict())
    ids = torch.randint(0, 50, (2, 16), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        expected = ours(input_ids=ids).last_hidden_state
    ours.save_pretrained(tmp_path / "checkpoint")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loaded = transformers.LlamaModel.from_pretrained(tmp_path / "checkpoint", attn_implementation="eager")
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids).last_hidden_state, expected, rtol=2e-5, atol=2e-5)
    _, again = models(llama_artifact)
    again.load_state_dict(loaded.state_dict())  # strict: every key read, none left
    with torch.no_grad():
        torch.testing.assert_close(again(input_ids=ids).last_hidden_state, expected, rtol=2e-5, atol=2e-5)
    wrong = {k: (v[:-1] if k.endswith("q_proj.weight") else v) for k, v in state.items()}
    with pytest.raises(RuntimeError, match=r"weight of shape \(63, 64\) does not match"):
        again.load_state_dict(wrong)
