"""Drop the tuned layer into Hugging Face BERT, GPT-2 and Llama-family models (Llama, Mistral, Qwen2,
Qwen2.5, Qwen3), as Liger-Kernel's ``apply_liger_kernel_to_*`` do.

``replace_bert_layers(model, out_dir)`` swaps every ``BertLayer`` of a HF model (``BertModel``,
``BertForMaskedLM``, ...) for a ``BertLayerReplacement`` around a tuned layer loaded from the
artifact, carrying the old layer's weights over; all replacements share one compiled program.
HF's attention mask is passed through to the fused attention as a key-padding mask.  Where
transformers has mask interfaces (``transformers.masking_utils.AttentionMaskInterface``), the model then
runs under the attention implementation ``KEY_PADDING``: HF hands the layers the (batch, keys)
padding mask it made of the model's ``attention_mask``, with no 4-D mask built and nothing waiting
for the GPU (HF's SDPA path asks whether the mask excludes anything, and a 4-D mask is checked to
be one per key: each a host-device sync, after which the GPU idles while the host launches the
next layers).  A 4-D mask (the user's, or from an older transformers) is converted once per model
call, and checked.

``replace_decoder_layers(model, out_dir)`` does the same for every decoder layer of a HF
Llama-family model whose class the artifact's spec names in its ``WEIGHTS``: ``LlamaDecoderLayer``
and ``MistralDecoderLayer`` (``configs/llama.py``), ``Qwen2DecoderLayer`` (``configs/qwen2.py``),
``Qwen3DecoderLayer`` (``configs/qwen3.py``); one function for the family, as the layers share
HF's call signature, and the artifact already says which classes it computes (a model of another
family is refused, naming the spec to tune; ``replace_llama_layers`` is its first name).  The
layer applies the causal mask itself (a sliding window is taken where it covers the sequence, the
same mask then), and the model runs under ``CAUSAL_KEY_PADDING``, which hands the layers the
(batch, keys) padding mask of the model's ``attention_mask``; the rotary tables the
model passes every layer (``position_embeddings``: cos and sin, [1 or batch, sequence, head dim])
are set as the layer's ``cos`` and ``sin`` constants where they changed, in new memory
(``TunedLayer.set_constant``): several forwards before one backward (DPO, contrastive losses) each
keep their own, and under activation checkpointing a layer's recomputation sets its call's
again.  Training only: the layers fill no key-value cache (a model making one keeps it empty; its
config is left as it is, so that a checkpoint saved from it generates with a cache when loaded
into HF's model), and a call with cached tokens (generation) is refused.

``replace_gpt2_blocks(model, out_dir)`` does the same for every ``GPT2Block`` of a HF ``GPT2Model`` /
``GPT2LMHeadModel`` with a tuned layer of a GPT-2 spec (``configs/gpt2.py``): its causal mask is
the layer's own (the fused attention's), and the model runs under ``CAUSAL_KEY_PADDING``.  The
block's arguments are read by the names of the installed transformers' ``GPT2Block.forward``
(their order changed between versions); training only, as Llama's.

All keep HF's outputs: ``output_hidden_states`` gets every layer's input and output as HF's own
layers give them (transformers >= 4.54 collects them with hooks on the layer classes the model
names, which the replacements are not: they add theirs to the active collection,
``_record_hidden_states``); ``output_attentions`` is refused (the fused attention forms no
attention weights).  Where the model loop takes a layer's outputs as a tuple (older transformers),
the replacements return one.
"""
from __future__ import annotations

import functools
import importlib
import inspect
import weakref

import torch

from datamove.export import check_config, load_layer, load_weights, module_kind, spec_values, state_dict_for
from datamove.dataflow.initial_values import WEIGHT
from datamove.runtime.module import TunedLayer


def key_padding_mask(attention_mask: torch.Tensor | None, batch: int, keys: int) -> torch.Tensor | None:
    """HF's attention mask as bool (batch, keys), True = key excluded (None for None).  A mask that
    excludes nothing is passed on as it is: asking would wait for the GPU in every step.

    Accepted: None; (batch, keys) with 1 = attend; (batch, 1, 1 | queries, keys) bool (True =
    attend) or additive float (0 = attend, negative = masked) that is the same for every query
    (a mask that differs between queries is not a key-padding mask and is refused)."""
    if attention_mask is None:
        return None
    if attention_mask.dim() == 2:
        excluded = attention_mask == 0
    elif attention_mask.dim() == 4 and attention_mask.shape[1] == 1:
        rows = attention_mask[:, 0]
        if rows.shape[1] > 1 and not bool((rows == rows[:, :1]).all()):
            raise ValueError("attention_mask differs between queries: only key-padding masks run through the fused "
                             "attention, a decoder's causal mask being the layer's own (pass the [batch, keys] "
                             "padding mask; a model whose attention implementation was set after its layers were "
                             f"replaced: set it back to {KEY_PADDING!r}, or {CAUSAL_KEY_PADDING!r} for the decoders)")
        row = rows[:, 0]
        excluded = ~row if row.dtype == torch.bool else row < 0
    else:
        raise ValueError(f"attention_mask of shape {tuple(attention_mask.shape)}: expected (batch, keys) or "
                         f"(batch, 1, 1 | queries, keys)")
    if tuple(excluded.shape) != (batch, keys):
        raise ValueError(f"attention_mask covers {tuple(excluded.shape)} (batch, keys), the layer ({batch}, {keys})")
    return excluded


class _LastMask:
    """The last attention mask converted and its key-padding mask: a HF model passes one mask
    tensor to every layer, so it is converted (and a 4-D mask checked, which waits for the GPU)
    once per model call, not once per layer."""

    def __init__(self):
        self.source, self.key, self.converted = None, None, None

    def __call__(self, attention_mask: torch.Tensor | None, batch: int, keys: int) -> torch.Tensor | None:
        if attention_mask is None or torch.compiler.is_compiling() or attention_mask.is_inference():
            return key_padding_mask(attention_mask, batch, keys)  # (an inference tensor has no version counter)
        source = self.source() if self.source is not None else None
        key = (attention_mask._version, batch, keys)
        if source is not attention_mask or self.key != key:
            self.converted = key_padding_mask(attention_mask, batch, keys)
            self.source, self.key = weakref.ref(attention_mask), key
        return self.converted


_last_mask = _LastMask()
KEY_PADDING = "datamove_key_padding"  # the attention implementation of a model whose BERT layers are replaced
CAUSAL_KEY_PADDING = "datamove_causal_key_padding"  # ... whose decoder layers (GPT-2's, Llama's) are replaced


def _key_padding_masks(*, mask_function=None, attention_mask=None, **kwargs):
    """HF's mask interface under ``KEY_PADDING``: the (batch, keys) bool padding mask HF made of the
    model's ``attention_mask`` (True = attend), as it is, or None; the replaced layers apply it as a
    key-padding mask.  A causal or combined mask (a decoder) is refused: the layers run none."""
    from transformers.masking_utils import bidirectional_mask_function

    if mask_function is not bidirectional_mask_function:
        raise ValueError("datamove: the replaced BERT layers take key-padding masks only; this model asks for a "
                         "causal or combined attention mask (a decoder)")
    return attention_mask


def _is_plain_sliding_window(mask_function) -> bool:
    """Whether ``mask_function`` is HF's sliding-window causal mask function as it is
    (``sliding_window_causal_mask_function``: ``and_masks`` of the window's overlay and the causal
    mask), with nothing else combined (packed sequences, a model's own overlays)."""
    from transformers.masking_utils import causal_mask_function

    if getattr(mask_function, "__qualname__", "") != "and_masks.<locals>.and_mask":
        return False
    cells = dict(zip(mask_function.__code__.co_freevars, (c.cell_contents for c in mask_function.__closure__ or ())))
    parts = cells.get("mask_functions", ())
    return len(parts) == 2 and parts[1] is causal_mask_function \
        and getattr(parts[0], "__qualname__", "") == "sliding_window_overlay.<locals>.inner_mask"


def _causal_key_padding_masks(*, mask_function=None, attention_mask=None, local_size=None, kv_length=None, **kwargs):
    """HF's mask interface under ``CAUSAL_KEY_PADDING``: as ``_key_padding_masks``, for a model that
    asks for a plain causal mask, which the replaced layers apply themselves, or for a sliding-window
    causal one whose window (``local_size``) covers all ``kv_length`` keys (Mistral's 4096 at a
    shorter sequence: the same mask); any other mask (a bidirectional one, packed sequences, a
    sliding window shorter than the sequence) is refused."""
    from transformers.masking_utils import causal_mask_function

    if local_size is not None and kv_length is not None and _is_plain_sliding_window(mask_function):
        if local_size < kv_length:
            raise ValueError(f"datamove: the model's sliding window ({local_size} positions) is shorter than the "
                             f"sequence ({kv_length}), and the replaced decoder layers attend over every position "
                             f"before (causal): tune the layer at a length of at most {local_size} (optimize-layer "
                             "--dims T=...) and call the model at it, or use a model without a sliding window")
        return attention_mask
    if mask_function is not causal_mask_function:
        combined = attention_mask is None and getattr(mask_function, "__qualname__", "").startswith("and_masks.")
        asked = ("a combined one, as HF does for packed sequences (position_ids restarting) and, under torch.compile, "
                 "for any call without an attention_mask: call the model with attention_mask=torch.ones_like(input_ids) "
                 "(packed sequences are not supported)" if combined else
                 "another attention mask (bidirectional, packed sequences or a sliding window)")
        raise ValueError("datamove: the replaced decoder layers apply a causal mask and a key-padding mask; this "
                         f"model asks for {asked}")
    return attention_mask


def _no_attention(module, *args, **kwargs):
    """HF's attention interface under ``KEY_PADDING``: no HF attention runs in a replaced model."""
    raise RuntimeError(f"datamove: {type(module).__name__} asked for HF attention under {KEY_PADDING!r}, the "
                       "implementation of models whose BERT layers were replaced; set another with "
                       "model.set_attn_implementation(...) to run HF attention modules")


def _route_key_padding_masks(model: torch.nn.Module, name: str = KEY_PADDING, masks=_key_padding_masks) -> None:
    """Run ``model`` under the attention implementation ``name`` whose mask interface is ``masks``,
    where transformers has mask interfaces."""
    try:
        from transformers.masking_utils import AttentionMaskInterface
        from transformers.modeling_utils import AttentionInterface
    except ImportError:  # an older transformers: its 4-D masks are converted and checked per model call
        return
    if hasattr(model, "set_attn_implementation"):
        AttentionInterface.register(name, _no_attention)
        AttentionMaskInterface.register(name, masks)
        model.set_attn_implementation(name)


NO_ATTENTION_WEIGHTS = ("datamove: output_attentions=True: the tuned layer's fused attention forms no attention "
                        "weights; call the model without output_attentions")


@functools.cache
def _collector():
    """transformers' variable holding the outputs its hooks collect in a model call, or None (a
    transformers without hooks collecting): looked up once, not on every layer call."""
    for where in ("transformers.utils.output_capturing", "transformers.utils.generic"):
        try:
            return importlib.import_module(where)._active_collector
        except (ImportError, AttributeError):
            continue
    return None


def _active_collection() -> dict | None:
    """The outputs HF is collecting in this model call ({"hidden_states": [...], "attentions": [...],
    ...}: the keys asked for), or None (none asked for, or a transformers without hooks collecting)."""
    active = _collector()
    try:
        return active.get() if active is not None else None
    except LookupError:  # a ContextVar without a default, not set
        return None


def _record_hidden_states(inputs: torch.Tensor, output: torch.Tensor) -> None:
    """Add a replaced layer's hidden states to HF's collection as HF's hook on its own layers does:
    the first layer's input, then each layer's output (``_hidden_states_layers``: the indices kept,
    None elsewhere).  ``output_attentions`` is refused."""
    collected = _active_collection()
    if not collected:
        return
    if "attentions" in collected or "cross_attentions" in collected:
        raise ValueError(NO_ATTENTION_WEIGHTS)
    states = collected.get("hidden_states")
    if states is None:
        return
    chosen = collected.get("_hidden_states_layers")
    for state in ([inputs] if not states else []) + [output]:
        states.append(state if chosen is None or len(states) in chosen else None)


def _sharded(layer: TunedLayer) -> bool:
    """Whether the layer's parameters are sharded (FSDP2's DTensors): their state dict is the engine's."""
    return any(type(p).__name__ == "DTensor" for p in layer.parameters())


def _hf_state(replacement, state_dict: dict, prefix: str, local_metadata) -> None:
    """State-dict hook of a replacement: the tuned layer's entries (``layer.<name>``, its layouts)
    given as the HF layer's (``state_dict_for``; its constants, which HF's layer has not, left out),
    so that a replaced model's ``state_dict`` and ``save_pretrained`` are HF's checkpoint
    (``from_pretrained`` of a HF model reads them back; they re-initialised every layer, named
    otherwise).  Sharded parameters (FSDP2) are left to the engine."""
    if _sharded(replacement.layer):
        return
    own = prefix + "layer."
    for key in [key for key in state_dict if key.startswith(own)]:
        del state_dict[key]
    for key, value in state_dict_for(replacement.layer, replacement.hf_kind).items():
        state_dict[prefix + key] = value


def _from_hf_state(replacement, state_dict: dict, prefix: str, local_metadata, strict, missing_keys,
                   unexpected_keys, error_msgs) -> None:
    """Load-state-dict pre-hook of a replacement: a HF layer's entries (a replaced model's own state
    dict, or a HF model's) read into the tuned layer's, in the spec's letter order (which the tuned
    layer's own pre-hook takes without an extra state); its constants, which HF's layer has not
    (the rotary tables, masks), kept as they are."""
    layer = replacement.layer
    theirs = {key[len(prefix):]: value for key, value in state_dict.items()
              if key.startswith(prefix) and not key.startswith(prefix + "layer.")}
    if not theirs or _sharded(layer):
        return
    for key in theirs:
        del state_dict[prefix + key]
    try:
        values = spec_values(layer, replacement.hf_kind, theirs)
    except (KeyError, ValueError) as err:  # a key missing, a weight of another shape
        error_msgs.append(f"{prefix.rstrip('.')}: {err}")
        return
    state_dict.pop(prefix + "layer._extra_state", None)
    for name, value in values.items():
        state_dict[prefix + "layer." + name] = value.contiguous()
    for name in layer.interface.constants:  # the layer's own (rotary tables, masks): not in HF's layer
        state_dict.setdefault(prefix + "layer." + name, layer.spec_view(name).detach())


class BertLayerReplacement(torch.nn.Module):
    """A HF ``BertLayer``'s call signature around a tuned layer: ``forward(hidden_states,
    attention_mask=None, ...)`` -> hidden states [batch, sequence, feature] (``returns_tuple``: as a
    1-tuple, for a transformers whose model loop takes the layer's first output; module doc).  HF's
    activation checkpointing (``model.gradient_checkpointing_enable()``) sets
    ``gradient_checkpointing`` and the checkpoint function, as on HF's own layers."""

    gradient_checkpointing = False

    def __init__(self, layer: TunedLayer, returns_tuple: bool = False, hf_kind: str | None = None):
        super().__init__()
        self.layer, self.returns_tuple, self.hf_kind = layer, returns_tuple, hf_kind
        if hf_kind is not None:  # the model's state dict in HF's format (save_pretrained, from_pretrained)
            self._register_state_dict_hook(_hf_state)
            self._register_load_state_dict_pre_hook(_from_hf_state, with_module=True)

    def _saw(self, cache) -> bool:
        """Whether this layer was called with the key-value ``cache`` before (kept as the last one, weakly).
        The layers fill no cache, so generation's next token comes with the empty cache of its first
        step: a call of another length than the tuned one runs now (a decoder's), and computed alone,
        without the earlier tokens, that token would be wrong; such a call is refused.  A training
        call gets a new cache from the model (or none)."""
        last = self._last_cache() if self._last_cache is not None else None
        self._last_cache = weakref.ref(cache)
        return last is cache

    _last_cache = None  # weakref of the last key-value cache a decoder's replacement was called with (``_saw``)

    def __getstate__(self) -> dict:
        """Pickled (``torch.save`` of the whole model) without the last cache's weak reference, which
        pickle cannot take (a model called with ``use_cache``, its default, could not be saved whole);
        the copy starts without one, as a new replacement does."""
        state = super().__getstate__()
        state.pop("_last_cache", None)
        return state

    def _output(self, hidden_states: torch.Tensor, attention_mask, kwargs: dict, extra: tuple = ()):
        """The layer on ``hidden_states`` as HF's model loop takes it (``_masked``): recorded where HF
        collects hidden states, a 1-tuple where ``returns_tuple``."""
        if kwargs.get("output_attentions"):  # an older transformers asks each layer
            raise ValueError(NO_ATTENTION_WEIGHTS)
        output = self._masked(hidden_states, attention_mask, extra)
        _record_hidden_states(hidden_states, output)
        return (output,) if self.returns_tuple else output

    def _layer(self, hidden_states: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        if mask is not None and not self.layer.applies_key_padding and not bool(mask.any()):
            mask = None  # excludes nothing, and a plan without the fused attention takes none (asking waits for the GPU)
        return self.layer(hidden_states, key_padding_mask=mask)

    def _masked(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None, extra: tuple = ()) -> torch.Tensor:
        """The layer on ``hidden_states`` with HF's ``attention_mask`` as its key-padding mask, under
        HF's activation checkpointing where it is on; ``extra``: further arguments of ``_layer``, the
        call's own, which a recomputation in the backward gets again (Llama's rotary tables)."""
        mask = _last_mask(attention_mask, hidden_states.shape[0], hidden_states.shape[1])
        if self.gradient_checkpointing and self.training and torch.is_grad_enabled():
            return self._gradient_checkpointing_func(self._layer, hidden_states, mask, *extra)
        return self._layer(hidden_states, mask, *extra)

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None, *args, **kwargs):
        if args and args[0] is not None or kwargs.get("encoder_hidden_states") is not None:
            raise ValueError("cross-attention (encoder_hidden_states) is not part of the tuned layer")
        return self._output(hidden_states, attention_mask, kwargs)


class LlamaLayerReplacement(BertLayerReplacement):
    """A HF ``LlamaDecoderLayer``'s call signature (Mistral's, Qwen2's and Qwen3's alike) around a
    tuned layer of a Llama-family spec (``configs/llama.py``, ``qwen2.py``, ``qwen3.py``):
    ``forward(hidden_states, attention_mask=None, position_ids=None, cache=None, use_cache=False,
    position_embeddings=None, ...)`` -> hidden states [batch, sequence, feature]; ``attention_mask``:
    the (batch, keys) padding mask ``CAUSAL_KEY_PADDING`` hands the layers (or a 4-D mask that is one
    per key), the causal mask being the layer's own; ``position_embeddings``: HF's rotary (cos, sin)."""

    def __init__(self, layer: TunedLayer, returns_tuple: bool = False, hf_kind: str | None = None):
        super().__init__(layer, returns_tuple, hf_kind)
        missing = [t for t in ("cos", "sin") if t not in layer.interface.constants]
        if missing:
            face = layer.interface
            graded = [t for t in missing if t in face.activations + face.parameters]
            why = (f"its spec gives {', '.join(graded)} a gradient: declare them as configs/llama.py does, "
                   "Tensor(\"se\", requires_grad=False)" if graded else
                   "not a Llama-family spec's layer (configs/llama.py, qwen2.py, qwen3.py)")
            raise ValueError(f"datamove: the tuned layer has no constant(s) {', '.join(missing)} for HF's rotary tables "
                             f"(position_embeddings): {why}")
        self._tables: tuple | None = None  # the (cos, sin) tensors last copied in, and their versions (None: unknown)

    def _copy_tables(self, cos: torch.Tensor, sin: torch.Tensor) -> None:
        """HF's rotary tables (cos, sin: [1 or batch, sequence, head dim]) set as the layer's constants
        where they are not the tensors last set (``set_constant``: new memory, so that a forward
        before, whose backward is still to run, keeps its own)."""
        # under torch.inference_mode the tables have no version counter: copied in on every call
        key = None if cos.is_inference() or sin.is_inference() else (cos, cos._version, sin, sin._version)
        if key is not None and self._tables is not None and all(a is b for a, b in zip(key[::2], self._tables[::2])) \
                and key[1::2] == self._tables[1::2]:
            return
        for name, table in (("cos", cos), ("sin", sin)):
            wanted = tuple(self.layer.spec_view(name).shape)
            if table.dim() == 3 and table.shape[0] > 1 and not torch.compiler.is_compiling():
                if not bool((table == table[:1]).all()):
                    raise ValueError("datamove: position_embeddings differ between the sequences of the batch "
                                     "(position_ids per sequence): the tuned layer holds one table for all")
            table = table[0] if table.dim() == 3 else table
            shorter = name in self.layer.interface.positions and 1 <= table.shape[0] < wanted[0]  # its leading rows
            if tuple(table.shape) != wanted and not (shorter and tuple(table.shape[1:]) == wanted[1:]):
                longer = table.shape[0] > wanted[0]
                fix = ("the model's rotary head dim is not the spec's: use a model of the spec's head_dim"
                       if tuple(table.shape[1:]) != wanted[1:] else
                       f"the layer's tables hold positions 0..{wanted[0] - 1}: truncate every batch to {wanted[0]}, or "
                       "tune the layer at your longest length (optimize-layer --dims T=...), which runs every shorter "
                       "batch (docs/runtime.md, Variable lengths; generation, model.generate, is not part of the tuned "
                       "layer)" if name in self.layer.interface.positions else
                       f"call the model at the sequence length the layer was tuned for, {wanted[0]}: "
                       + (f"truncate to it, or tune the layer at your longest length (optimize-layer --dims T=...) and "
                          "pad every batch to that" if longer else "pad every batch to it") +
                       " with an attention_mask of the padding (the tokenizer or DataCollatorWithPadding with "
                       f"padding='max_length', max_length={'that length' if longer else wanted[0]}; docs/runtime.md, "
                       "Variable lengths; generation, model.generate, is not part of the tuned layer)")
                raise ValueError(f"datamove: position_embeddings' {name} is {tuple(table.shape)} (sequence, head "
                                 f"dim); the tuned layer's is {wanted}: {fix}")
            self.layer.set_constant(name, table, check_nan=False)  # HF's tables: cos and sin of finite angles
        self._tables = key

    def _layer(self, hidden_states: torch.Tensor, mask: torch.Tensor | None, cos: torch.Tensor,
               sin: torch.Tensor) -> torch.Tensor:
        """The layer with the call's rotary tables: under activation checkpointing its recomputation
        sets them again where a later forward set others (its backward computed with those)."""
        self._copy_tables(cos, sin)
        return super()._layer(hidden_states, mask)

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, cache=None, use_cache: bool | None = False,
                position_embeddings: tuple | None = None, **kwargs):
        cache = cache if cache is not None else kwargs.get("past_key_values")
        if cache is not None and (cache.get_seq_length() > 0 or self._saw(cache)):
            raise ValueError("datamove: the replaced decoder layers train; generation with a key-value cache is not "
                             "part of the tuned layer")
        if position_embeddings is None:
            raise ValueError("datamove: a replaced decoder layer needs the model's position_embeddings (cos, sin)")
        return self._output(hidden_states, attention_mask, kwargs, tuple(position_embeddings))


class GPT2BlockReplacement(BertLayerReplacement):
    """A HF ``GPT2Block``'s call signature around a tuned layer of a GPT-2 spec: its arguments by the
    names of the installed ``GPT2Block.forward`` (``hidden_states``, the cache, ``attention_mask``:
    the (batch, keys) padding mask ``CAUSAL_KEY_PADDING`` hands the blocks, or a 4-D mask that is
    one per key; the causal mask is the layer's own) -> hidden states [batch, sequence, feature]."""

    def __init__(self, layer: TunedLayer, returns_tuple: bool = False, hf_kind: str | None = None):
        super().__init__(layer, returns_tuple, hf_kind)
        from transformers.models.gpt2.modeling_gpt2 import GPT2Block

        self._names = list(inspect.signature(GPT2Block.forward).parameters)[1:]  # without self

    def forward(self, *args, **kwargs):
        given = {**dict(zip(self._names, args)), **kwargs}
        if given.get("encoder_hidden_states") is not None:
            raise ValueError("cross-attention (encoder_hidden_states) is not part of the tuned layer")
        if given.get("head_mask") is not None:
            raise ValueError("datamove: a head_mask is not part of the tuned layer")
        cache = next((given[n] for n in ("cache", "past_key_values", "layer_past") if given.get(n) is not None), None)
        holds = cache is not None and (cache.get_seq_length() if hasattr(cache, "get_seq_length") else True)
        if cache is not None and (holds or self._saw(cache)):
            raise ValueError("datamove: the replaced GPT-2 blocks train; generation with a key-value cache is not "
                             "part of the tuned layer")
        return self._output(given["hidden_states"], given.get("attention_mask"), given)


# The spec to tune for each HF layer class the replacements take (refusals name it)
SPEC_OF = {"BertLayer": "configs/bert.py", "GPT2Block": "configs/gpt2.py", "LlamaDecoderLayer": "configs/llama.py",
           "MistralDecoderLayer": "configs/llama.py", "Qwen2DecoderLayer": "configs/qwen2.py",
           "Qwen3DecoderLayer": "configs/qwen3.py"}


def _replace(model: torch.nn.Module, out_dir, kinds: tuple[str, ...], replacement, load_kwargs: dict) -> int:
    """Replace every module whose class is one of ``kinds`` (class names) in ``model`` by
    ``replacement`` around a tuned layer carrying its weights (one compiled program for all:
    ``TunedLayer.sibling``); a model with none of them is refused, naming the spec of the layers it has."""
    named = " or ".join(kinds)
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"datamove: replacing the {named}s of a model: expected a HF model (a torch.nn.Module), got "
                        f"{type(model).__name__}")
    first: TunedLayer | None = None
    replaced = 0
    # transformers >= 4.54 (its models name the layers whose outputs hooks collect) takes a layer's
    # hidden states as its output; before, the model loop took the first of a tuple
    returns_tuple = not any(getattr(m, "_can_record_outputs", None) for m in model.modules())
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            kind = type(child).__name__
            if kind not in kinds:
                continue
            if first is None:
                weight = next(child.parameters())
                layer = first = load_layer(out_dir, **{"device": weight.device, **load_kwargs})
                # the whole model's, before any weight; a model without dropout trains the layers without it
                layer.dropout_off = check_config(getattr(model, "config", None), layer.hf_config)
                if weight.dtype != layer.dtype:  # its calls would be refused, the hidden states of the model's dtype
                    raise TypeError(f"datamove: the model's {kind} weights are {weight.dtype} and the tuned layer computes "
                                    f"in {layer.dtype}: convert the model first (model.to({layer.dtype})), or load the "
                                    f"layer in the model's dtype (dtype={weight.dtype}, allow_mismatch=True: the plan "
                                    "then runs untuned in it)")
            else:
                layer = first.sibling()
            load_weights(layer, child)
            setattr(parent, name, replacement(layer, returns_tuple, module_kind(layer, child)).train(child.training))
            replaced += 1
    if not replaced:
        found = sorted({type(m).__name__ for m in model.modules() if type(m).__name__.endswith(("Layer", "Block"))})
        specs = sorted({f"{SPEC_OF[f]} for a {f}" for f in found if f in SPEC_OF})
        raise ValueError(f"datamove: no {named} in the model to replace (its layers: {', '.join(found) or 'none'}); "
                         f"the tuned layer stands in for HF's {named} only"
                         + (f": tune the spec of the model's family ({'; '.join(specs)}) with optimize-layer and "
                            "replace with that artifact" if specs else ""))
    return replaced


def decay_parameter_names(model: torch.nn.Module) -> list[str]:
    """The names of ``model``'s parameters that HF's ``Trainer`` gives weight decay, as it would were
    the replaced layers HF's: ``Trainer.get_decay_parameter_names`` goes by names ('bias', 'norm')
    and LayerNorm modules, which a tuned layer's spec names (``bq``, ``ln1_gamma``) escape, so its
    biases and norm gains would decay.  A tuned layer's parameters decay where an einsum reads them
    (``initial_values``' weights: the projections), the rest of the model by HF's rule.  Use it in a
    ``Trainer`` subclass's ``get_decay_parameter_names``, or for your optimizer's groups."""
    from transformers import Trainer

    tuned = {name: module.layer for name, module in model.named_modules() if isinstance(module, BertLayerReplacement)}
    names = [n for n in Trainer.get_decay_parameter_names(None, model)
             if not any(n.startswith(f"{prefix}.layer.") for prefix in tuned)]
    return names + [f"{prefix}.layer.{name}" for prefix, layer in tuned.items()
                    for name, _ in layer.named_parameters() if layer.initial[name] == WEIGHT]


def replace_bert_layers(model: torch.nn.Module, out_dir, **load_kwargs) -> int:
    """Replace every ``BertLayer`` in ``model`` in place (and route its attention mask to them as a
    key-padding mask, ``KEY_PADDING``); returns how many were replaced."""
    replaced = _replace(model, out_dir, ("BertLayer",), BertLayerReplacement, load_kwargs)
    if replaced:
        _route_key_padding_masks(model)
    return replaced


def replace_gpt2_blocks(model: torch.nn.Module, out_dir, **load_kwargs) -> int:
    """Replace every ``GPT2Block`` in ``model`` (a HF ``GPT2Model`` or ``GPT2LMHeadModel``) in place by
    a tuned layer of a GPT-2 spec (``configs/gpt2.py``) carrying its weights, and route the model's
    padding mask to them (``CAUSAL_KEY_PADDING``); returns how many were replaced."""
    replaced = _replace(model, out_dir, ("GPT2Block",), GPT2BlockReplacement, load_kwargs)
    if replaced:
        _route_key_padding_masks(model, CAUSAL_KEY_PADDING, _causal_key_padding_masks)
    return replaced


def _decoder_kinds(out_dir) -> tuple[str, ...]:
    """The HF decoder layer classes an artifact's spec gives weights for (its ``WEIGHTS``' kinds
    ending in ``DecoderLayer``: ``LlamaDecoderLayer`` and ``MistralDecoderLayer`` for ``configs/llama.py``)."""
    from datamove.export import read_manifest

    named = [kind.split(".")[-1] for kind in read_manifest(out_dir)["weights"]]
    kinds = tuple(kind for kind in named if kind.endswith("DecoderLayer"))
    if not kinds:
        raise ValueError(f"datamove: the tuned layer of {out_dir} stands in for no HF decoder layer (its spec's WEIGHTS "
                         f"name {', '.join(named) or 'none'}): tune a Llama-family spec (configs/llama.py, "
                         "configs/qwen2.py, configs/qwen3.py), or use replace_bert_layers / replace_gpt2_blocks for "
                         "those layers")
    return kinds


def replace_decoder_layers(model: torch.nn.Module, out_dir, **load_kwargs) -> int:
    """Replace every decoder layer of a HF Llama-family model (``LlamaModel`` / ``LlamaForCausalLM``,
    Mistral's, Qwen2's and Qwen2.5's, Qwen3's) in place by the tuned layer of ``out_dir`` carrying
    its weights: the layers of the classes its spec's ``WEIGHTS`` name (``configs/llama.py``:
    ``LlamaDecoderLayer`` and ``MistralDecoderLayer``; ``configs/qwen2.py``: ``Qwen2DecoderLayer``;
    ``configs/qwen3.py``: ``Qwen3DecoderLayer``); a model of another family is refused, naming the
    spec of its layers.  Routes the model's padding mask to them (``CAUSAL_KEY_PADDING``); returns
    how many were replaced."""
    replaced = _replace(model, out_dir, _decoder_kinds(out_dir), LlamaLayerReplacement, load_kwargs)
    _route_key_padding_masks(model, CAUSAL_KEY_PADDING, _causal_key_padding_masks)
    return replaced


replace_llama_layers = replace_decoder_layers  # its first name, when it took Llama's layers only
