"""``replace_gpt2_blocks``: a HF ``GPT2Model``'s blocks replaced by the tuned layer of
``configs/gpt2.py`` (the main job's artifact at small odd dims), on the CPU (the torch backend),
against the model untouched in float32 with dropout off: the output at every unpadded position and
the gradient of every parameter, without padding and with left padding; the model's checkpoint
stays HF's; what the blocks cannot do (a config the spec does not compute, generation) is refused
in one line."""

import pytest
import torch

from datamove.hf import GPT2BlockReplacement, decay_parameter_names, replace_gpt2_blocks
from conftest import GPT2_DIMS
from hf_models import check_against_hf, check_padded, replaced_pair

transformers = pytest.importorskip("transformers")
TOLERANCE = 2e-5  # float32 against float32, relative to the largest value
DIMS = GPT2_DIMS


def models(artifact, **changes):
    config = transformers.GPT2Config(**{**dict(vocab_size=50, n_positions=32, n_embd=DIMS["D"], n_layer=2,
                                                n_head=DIMS["H"], n_inner=DIMS["F"]), **changes})
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    return replaced_pair(transformers.GPT2Model(config).eval(), replace_gpt2_blocks, artifact, 2, 0.2)


@pytest.mark.parametrize("padded", [False, True], ids=["unpadded", "left-padded"])
def test_a_replaced_gpt2_model_computes_as_hf(gpt2_artifact, padded):
    reference, ours = models(gpt2_artifact)
    assert all(isinstance(block, GPT2BlockReplacement) for block in ours.h)
    ids = torch.randint(0, 50, (DIMS["B"], DIMS["T"]), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(DIMS["B"], DIMS["T"], dtype=torch.long)
    if padded:
        mask[1, :4] = 0
    check_against_hf(reference, ours, ids, mask, TOLERANCE)


def test_batches_of_any_length_compute_as_hf(gpt2_artifact):
    """GPT-2's causal mask is known at any length (``datamove.runtime.call_constants``): batches
    shorter (odd, 1) and longer than the tuned T=13, each padded on the right to its longest
    sequence (a collator padding each batch to its longest), unpadded and left-padded, compute as
    HF's model given the same, output and every gradient, and each sequence as HF's on it alone
    (they were refused: pad every batch to T).  Padded to T, as the refusal said, still so."""
    reference, ours = models(gpt2_artifact)
    T = DIMS["T"]
    for lengths in ([T - 4, 1, T - 6], [1], [T + 6, T + 1], [5, 5]):
        check_padded(reference, ours, lengths, max(lengths), 50, TOLERANCE)
    check_padded(reference, ours, [T - 4, 1, T], T, 50, TOLERANCE)
    ids = torch.randint(0, 50, (2, 9), generator=torch.Generator().manual_seed(4))
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[1, :3] = 0
    check_against_hf(reference, ours, ids, mask, TOLERANCE)


def test_generation_without_a_cache_is_hfs_and_with_one_refused(gpt2_artifact):
    """Without a cache each step of ``generate`` runs the whole sequence again, a call of its length
    (any, now): the tokens are HF's; with a cache, the second step (one token, the cache the blocks
    left empty) would compute the token alone, wrongly (it ran once calls of any length did), and
    is refused."""
    config = transformers.GPT2Config(vocab_size=50, n_positions=32, n_embd=DIMS["D"], n_layer=2, n_head=DIMS["H"],
                                     n_inner=DIMS["F"], attn_implementation="eager")
    torch.manual_seed(0)
    reference, ours = replaced_pair(transformers.GPT2LMHeadModel(config).eval(), replace_gpt2_blocks, gpt2_artifact,
                                    2, 0.2)
    ids = torch.randint(0, 50, (2, 5), generator=torch.Generator().manual_seed(6))
    asked = dict(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert torch.equal(ours.generate(**asked, use_cache=False), reference.generate(**asked, use_cache=False))
    with pytest.raises(ValueError, match="generation with a key-value cache is not part of the tuned layer"):
        ours.generate(**asked, use_cache=True)


def test_a_replaced_gpt2_models_checkpoint_is_hfs(gpt2_artifact, tmp_path):
    reference, ours = models(gpt2_artifact)
    assert sorted(ours.state_dict()) == sorted(reference.state_dict())
    ours.save_pretrained(tmp_path / "checkpoint")
    loaded = transformers.GPT2Model.from_pretrained(tmp_path / "checkpoint", attn_implementation="eager").eval()
    ids = torch.randint(0, 50, (DIMS["B"], DIMS["T"]), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids).last_hidden_state, ours(input_ids=ids).last_hidden_state,
                                   rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("setting, value", [("activation_function", "gelu"), ("layer_norm_epsilon", 1e-6),
                                            ("scale_attn_by_inverse_layer_idx", True), ("resid_pdrop", 0.0)])
def test_a_model_configured_otherwise_is_refused(gpt2_artifact, setting, value):
    """The erf GELU, another epsilon, per-layer attention scaling, another dropout (one rate 0, the
    other the spec's): the blocks would have computed the spec's without a word (``configs/gpt2.py``'s
    ``HF_CONFIG``)."""
    with pytest.raises(ValueError, match=f"the model's config asks for what the tuned layer does not compute: "
                                         f"{setting}={value!r}"):
        models(gpt2_artifact, **{setting: value})


def test_a_model_without_dropout_trains_the_blocks_without_it(gpt2_artifact):
    """Dropout rates all 0 (a model that trains without dropout; the spec's are 0.1): the blocks train
    with the plan's evaluation program, equal to HF's model in training mode; rates neither the
    spec's nor all 0 stay refused."""
    config = dict(vocab_size=50, n_positions=32, n_embd=DIMS["D"], n_layer=2, n_head=DIMS["H"], n_inner=DIMS["F"],
                  attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0)
    model = transformers.GPT2Model(transformers.GPT2Config(**config, attn_implementation="eager")).train()
    reference, ours = replaced_pair(model, replace_gpt2_blocks, gpt2_artifact, 2, 0.2)
    assert ours.training and all(block.layer.training and block.layer.dropout_off for block in ours.h)
    ids = torch.randint(0, 50, (DIMS["B"], DIMS["T"]), generator=torch.Generator().manual_seed(3))
    mask = torch.ones(DIMS["B"], DIMS["T"], dtype=torch.long)
    mask[0, :3] = 0
    check_against_hf(reference, ours, ids, mask, TOLERANCE)
    with pytest.raises(ValueError, match=r"attn_pdrop=0\.2.*\(dropout rates: the spec's, or all 0"):
        models(gpt2_artifact, attn_pdrop=0.2, resid_pdrop=0.0)


def test_weight_decay_falls_on_the_parameters_hf_decays(gpt2_artifact):
    """HF's Trainer decays by names and LayerNorm modules, which the blocks' spec names escape (their
    biases and gains would decay); ``decay_parameter_names`` gives the replaced model HF's choice:
    each decayed parameter of a block is read from a tensor HF decays, each HF decays is covered."""
    reference, ours = models(gpt2_artifact)
    hf_decayed = set(transformers.Trainer.get_decay_parameter_names(None, reference))
    assert any(".layer.b" in n for n in transformers.Trainer.get_decay_parameter_names(None, ours))  # HF's own rule
    ours_decayed, covered = decay_parameter_names(ours), set()
    for name in ours_decayed:
        if ".layer." not in name:
            assert name in hf_decayed, name
            covered.add(name)
            continue
        block, tensor = name.split(".layer.")
        replacement = ours.get_submodule(block)
        key = replacement.layer.weights_table[replacement.hf_kind][tensor][0]
        assert f"{block}.{key}" in hf_decayed, name
        covered.add(f"{block}.{key}")
    assert covered == hf_decayed


def test_generation_and_cross_attention_are_refused(gpt2_artifact):
    _, ours = models(gpt2_artifact)
    x = torch.randn(DIMS["B"], DIMS["T"], DIMS["D"])
    with pytest.raises(ValueError, match="cross-attention"):
        ours.h[0](x, encoder_hidden_states=x)
    cache = transformers.DynamicCache()
    cache.update(torch.randn(DIMS["B"], DIMS["H"], 3, DIMS["E"]), torch.randn(DIMS["B"], DIMS["H"], 3, DIMS["E"]), 0)
    with pytest.raises(ValueError, match="generation with a key-value cache is not part of the tuned layer"):
        ours.h[0](x, past_key_values=cache)
    with pytest.raises(ValueError, match="output_attentions=True"):
        ours(input_ids=torch.randint(0, 50, (DIMS["B"], DIMS["T"])), output_attentions=True)
