"""The exported layer at other batch sizes and sequence lengths than it was tuned at (CPU, Triton
interpreter, float32, small odd sizes): equal to HF's ``BertLayer`` (dropout off) forward and in
every gradient, with and without a key-padding mask; a multi-shape artifact written by the main
job dispatching to each plan; the nearest-plan rule; ``--dims`` alternatives.
"""
import math
import warnings

import pytest
import torch

from datamove.cli import _dims
from datamove.dataflow.spec import SpecError
from datamove.dataflow.snapshot import stored_fused
from datamove.runtime.layer import LayerProgram, tensor_interface
from datamove.runtime.shapes import call_dims, check_plans, fit_plan, nearest
from datamove.runtime.weights import from_spec
from plans import selected_plan, spec_module, spec_order_plan
from test_export import BERT_DIMS, FLOAT32_TOLERANCE, GPT2_DIMS, error, load, small_bert_config, small_bert_model, write

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="float32 through the Triton interpreter (CPU)")
SMALL = dict(B=2, N=64, H=2, P=32, U=128)  # the job's sizes (tests/test_job.py), L given per shape


@pytest.fixture(scope="module")
def bert(tmp_path_factory):
    return write(tmp_path_factory.mktemp("shapes"), "bert", BERT_DIMS, selected_plan)


def hf_layer(dims: dict):
    transformers = pytest.importorskip("transformers")
    from transformers.models.bert.modeling_bert import BertLayer

    config = transformers.BertConfig(hidden_size=dims["N"], num_attention_heads=dims["H"], intermediate_size=dims["U"],
                                     hidden_act="relu", layer_norm_eps=1e-12, attention_probs_dropout_prob=0.0,
                                     hidden_dropout_prob=0.0)
    config._attn_implementation = "eager"
    reference = BertLayer(config).double().eval()
    with torch.no_grad():
        for p in reference.parameters():
            p.normal_(0.0, 0.3)
    return reference


def compare_with_hf(layer, reference, batch: int, length: int, padded: list[int] | None = None, seed: int = 0) -> None:
    """Forward, input gradient and every parameter gradient of ``layer`` (evaluation mode) at
    (batch, length) against ``reference`` in float64; ``padded``: per batch row, how many trailing
    keys the key-padding mask excludes."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, length, layer.graph.size("i"), dtype=torch.float64, generator=gen, requires_grad=True)
    x32 = x.detach().float().requires_grad_()
    mask, additive = None, None
    if padded is not None:
        mask = torch.zeros(batch, length, dtype=torch.bool)
        for row, count in enumerate(padded):
            mask[row, length - count:] = True
        additive = (mask.double() * -1e9)[:, None, None, :]
    for p in layer.parameters():
        p.grad = None
    reference.zero_grad(set_to_none=True)
    y = layer(x32, key_padding_mask=mask)
    expected = reference(x, attention_mask=additive)
    expected = expected[0] if isinstance(expected, tuple) else expected
    grad = torch.randn(expected.shape, dtype=torch.float64, generator=gen)
    y.backward(grad.float())
    expected.backward(grad)
    assert y.shape == (batch, length, layer.graph.size("i"))
    assert error(y.detach(), expected.detach()) < FLOAT32_TOLERANCE, "forward"
    assert error(x32.grad, x.grad) < FLOAT32_TOLERANCE, "gradient of x"
    kind = next(k for k in layer.weights_table if k.endswith("BertLayer"))
    sizes = {letter: layer.graph.size(letter) for letter in layer.graph.letter_dims}
    ours = {}
    for name, (key, pattern, index) in layer.weights_table[kind].items():
        ours[key] = from_spec(layer.spec_view(name, getattr(layer, name).grad), pattern, index, layer.graph.tensors[name].letters, sizes,
                              ours.get(key))
    largest = max(float(p.grad.norm()) for p in reference.parameters())
    for key, p in reference.named_parameters():
        assert error(ours[key], p.grad, largest) < FLOAT32_TOLERANCE, key


def test_equals_hf_bert_layer_at_other_batches_and_lengths(bert):
    """Tuned at B=3, L=23 (the cost model's plan: fused attention, GEMM epilogues, layout changes):
    B=1, B=6, a shorter sequence and a longer one, with and without a key-padding mask, then back to
    earlier shapes (the layer keeps its last call's program: ``TunedLayer._call_program``); each
    shape warns once that it runs an untuned plan; a call of a wrong size after them is refused."""
    from datamove.export import load_weights

    reference = hf_layer(BERT_DIMS)
    layer = load(bert)
    load_weights(layer, reference).eval()
    cases = [(1, 23, None), (6, 23, None), (3, 11, None), (3, 11, [0, 4, 10]), (2, 41, [7, 0]), (1, 23, None),
             (3, 11, [2, 0, 5])]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for batch, length, padded in cases:
            compare_with_hf(layer, reference, batch, length, padded)
    untuned = [str(w.message) for w in caught if "has no plan of its own" in str(w.message)]
    assert len(untuned) == 4 and all("runs the plan tuned at B=3, L=23" in m for m in untuned), untuned
    with pytest.raises(ValueError, match="shape"):
        layer(torch.randn(3, 11, layer.graph.size("i") + 1))


def test_spec_order_plan_at_a_longer_sequence(tmp_path):
    """The plan without fused attention: its softmax over the keys holds whole rows in one tile
    (mode "row", a block of 32 keys at L=23); at L=45 the block grows to cover the row."""
    from datamove.export import load_weights

    reference = hf_layer(BERT_DIMS)
    layer = load(write(tmp_path, "bert", BERT_DIMS, spec_order_plan))
    load_weights(layer, reference).eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        compare_with_hf(layer, reference, 2, 45)
    program = layer.program(False, {"B": 2, "L": 45})
    tuned = {s.name: s for s in layer.plan.steps}
    grown = [s.name for s in program.plan.steps if s.kind == "generated" and s.config.knobs != tuned[s.name].config.knobs]
    assert grown, "no knob was fitted to the longer rows"


def test_row_mode_too_long_for_one_tile_becomes_loop():
    """A row that no longer fits a tile (over ``MAX_TILE`` with its parallel block) loops over chunks."""
    fused = stored_fused()["bert"].with_dims(BERT_DIMS)
    plan = spec_order_plan(fused, "bert")
    long = fused.graph.with_dims({**fused.graph.dim_values, "B": 3, "L": 5000})
    fitted = {s.name: s for s in fit_plan(plan, long, fused.operators, 4).steps}
    rows = [s for s in plan.steps if s.kind == "generated" and "parts" not in s.config.knobs
            and s.config.knobs["mode"] == "row"]
    assert rows
    for step in rows:
        knobs = fitted[step.name].config.knobs
        assert knobs["mode"] == "loop" or knobs["block_row"] * knobs["block_col"] <= 16384, (step.name, knobs)
    assert any(fitted[s.name].config.knobs["mode"] == "loop" for s in rows)
    assert fit_plan(plan, fused.graph, fused.operators, 4).steps == plan.steps  # at its own sizes: as chosen


def test_a_cublas_algorithm_holds_at_its_sizes_only():
    """A cuBLAS step's ``algorithm`` (an index into cuBLASLt's heuristic's list at the tuned sizes)
    is dropped at other sizes, kept at its own."""
    from dataclasses import replace

    fused = stored_fused()["bert"].with_dims(BERT_DIMS)
    plan = spec_order_plan(fused, "bert")
    plan = replace(plan, steps=[replace(s, config=replace(s.config, algorithm=3)) if s.kind == "gemm" else s
                                for s in plan.steps])
    longer = fused.graph.with_dims({**fused.graph.dim_values, "L": 40})
    assert all(not getattr(s.config, "algorithm", 0) for s in fit_plan(plan, longer, fused.operators, 4).steps)
    assert fit_plan(plan, fused.graph, fused.operators, 4).steps == plan.steps


def test_call_dims_are_those_no_weight_carries_nor_a_constant_of_unknown_values():
    """GPT-2's T: its causal mask [T, T] is known at any T (T was fixed by it); Llama's T: its rotary
    tables, of values the caller sets, fix it unless the spec declares them position tables."""
    for spec, expected in (("bert", ("B", "L")), ("gpt2", ("B", "T"))):
        graph = stored_fused()[spec].graph
        assert call_dims(graph, tensor_interface(graph, getattr(spec_module(spec), "TORCH_ORDER", {}))) == expected
    from datamove.dataflow.analysis_cache import cached_analysis

    graph = cached_analysis("configs/llama.py", {}, {}).fused.graph
    assert call_dims(graph, tensor_interface(graph)) == ("B",)
    assert call_dims(graph, tensor_interface(graph, positions=("cos", "sin"))) == ("B", "T")
    for positions, refusal in ((("wq",), "POSITION_TABLES names 'wq': it has a gradient"),
                               (("causal",), "POSITION_TABLES names 'causal': the graph gives it its value"),
                               ("cos", r"POSITION_TABLES = 'cos': expected a tuple of constant names")):
        with pytest.raises(ValueError, match=refusal):
            tensor_interface(graph, positions=positions)


def test_nearest_plan_rule():
    tuned = [{"B": 8, "L": 128}, {"B": 8, "L": 512}, {"B": 4, "L": 256}]
    assert nearest(tuned, {"B": 8, "L": 512}) == 1  # a tuned shape: its own
    assert nearest(tuned, {"B": 8, "L": 200}) == 1  # 1600 tokens: the smallest tuned at least as large (4096)
    assert nearest(tuned, {"B": 2, "L": 100}) == 0  # 200: 1024 tokens each for 0 and 2, closer sizes win
    assert nearest(tuned, {"B": 16, "L": 512}) == 1  # larger than all: the largest
    assert nearest(tuned, {"B": 1, "L": 1}) == 0


def test_dims_alternatives_are_parsed_and_bad_ones_refused():
    assert _dims("B=8,L=128|256|512") == [{"B": 8, "L": 128}, {"B": 8, "L": 256}, {"B": 8, "L": 512}]
    assert _dims("B=2|4,L=7|9") == [{"B": 2, "L": 7}, {"B": 2, "L": 9}, {"B": 4, "L": 7}, {"B": 4, "L": 9}]
    assert _dims(None) == [{}]
    for text, message in (("L=128|x", "L=128|x: expected an integer or integers separated by '|'"),
                          ("L=128||256", "L=128||256: expected an integer"),
                          ("L=128|128", "given once"), ("B=0,L=7|-3", "B=0, L=-3: dims must be positive integers")):
        with pytest.raises(SpecError, match=message.replace("|", r"\|")):
            _dims(text)


def test_plans_that_cannot_share_weights_are_refused():
    fused = stored_fused()["bert"].with_dims(BERT_DIMS)
    graph, order = fused.graph, spec_module("bert").TORCH_ORDER
    face = tensor_interface(graph, order)
    plan = spec_order_plan(fused, "bert")
    other = spec_order_plan(fused.with_dims({**graph.dim_values, "N": 48}), "bert")
    with pytest.raises(ValueError, match="N=48, the first N=32: only B, L may differ"):
        check_plans([plan, other], graph, face)
    with pytest.raises(ValueError, match="two plans tuned at B=3, L=23"):
        check_plans([plan, plan], graph, face)
    moved = spec_order_plan(fused.with_dims({**graph.dim_values, "L": 9}), "bert")
    moved.layouts["wq"] = moved.layouts["wq"][::-1]
    with pytest.raises(ValueError, match="stores wq in another layout"):
        check_plans([plan, moved], graph, face)


@pytest.fixture(scope="module")
def two_shapes(tmp_path_factory):
    """The main job's artifact of two shapes (cost model): B=2 with L=64 and L=32."""
    from datamove.cli import main

    out = tmp_path_factory.mktemp("job") / "bert"
    dims = ",".join(f"{k}={v}" for k, v in SMALL.items())
    assert main(["configs/bert.py", "--dims", dims + ",L=64|32", "--out", str(out)]) == 0
    return out


def test_the_job_writes_one_plan_per_shape_and_the_layer_dispatches(two_shapes, monkeypatch):
    import json

    manifest = json.loads((two_shapes / "manifest.json").read_text())
    assert manifest["shapes"] == [{"dims": {"B": 2, "L": 64}, "plan": "plan.json"},
                                  {"dims": {"B": 2, "L": 32}, "plan": "plans/B2-L32.json"}]
    assert "Shapes tuned, one plan each (this report: the first): B=2, L=64" in (two_shapes / "report.md").read_text()
    layer = load(two_shapes, allow_mismatch=True).eval()
    assert [p.dims["L"] for p in layer.plans] == [64, 32]
    ran = []
    forward = LayerProgram.forward
    monkeypatch.setattr(LayerProgram, "forward", lambda self, store, run: ran.append(self) or forward(self, store, run))
    reference = hf_layer({**SMALL, "L": 0})
    from datamove.export import load_weights

    load_weights(layer, reference)
    gen = torch.Generator().manual_seed(1)
    with warnings.catch_warnings(record=True) as caught, torch.no_grad():
        warnings.simplefilter("always")
        for length, tuned in ((64, 0), (32, 1), (40, 0), (40, 0), (5, 1)):
            x = torch.randn(2, length, SMALL["N"], dtype=torch.float64, generator=gen)
            y = layer(x.float())
            assert ran[-1].graph.dim_values["L"] == length
            assert layer.dispatch({"B": 2, "L": length}) is layer.plans[tuned]
            if length in (64, 32):
                assert ran[-1].plan is layer.plans[tuned]  # a tuned shape runs its plan as chosen
            else:
                assert [s.name for s in ran[-1].plan.steps] == [s.name for s in layer.plans[tuned].steps]
            expected = reference(x)
            assert error(y, expected[0] if isinstance(expected, tuple) else expected) < FLOAT32_TOLERANCE, length
        layer.train()
        layer(torch.randn(2, 40, SMALL["N"], generator=gen))  # training mode at L=40: a new program, no new warning
    untuned = [str(w.message) for w in caught if "has no plan of its own" in str(w.message)]
    assert len(untuned) == 2, untuned
    assert untuned[0].startswith("datamove: B=2, L=40 has no plan of its own (tuned: B=2, L=64; B=2, L=32): it runs "
                                 "the plan tuned at B=2, L=64")
    assert "B=2, L=5" in untuned[1] and "tuned at B=2, L=32" in untuned[1]


def test_hf_model_runs_at_the_batch_and_sequence_it_is_given(bert, monkeypatch):
    """A HF model whose layers were replaced, at another batch and sequence than the artifact's,
    with padding (the attention mask becomes a key-padding mask of the model's current shape):
    where transformers has mask interfaces the layers get HF's (batch, keys) padding mask itself,
    no 4-D mask to convert and check (each a wait for the GPU)."""
    transformers = pytest.importorskip("transformers")
    from datamove.hf import KEY_PADDING, BertLayerReplacement, replace_bert_layers

    given = []
    forward = BertLayerReplacement.forward
    monkeypatch.setattr(BertLayerReplacement, "forward", lambda self, hidden, attention_mask=None, *args, **kwargs: (
        given.append(attention_mask), forward(self, hidden, attention_mask, *args, **kwargs))[1])
    model, original = small_bert_model(transformers)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert replace_bert_layers(model, bert, dtype=torch.float32) == 2
        ids = torch.randint(0, 50, (4, 13), generator=torch.Generator().manual_seed(3))
        mask = torch.ones(4, 13, dtype=torch.long)
        mask[1, 9:] = 0
        mask[3, 2:] = 0
        ours = model(input_ids=ids, attention_mask=mask).last_hidden_state
    expected = original(input_ids=ids, attention_mask=mask).last_hidden_state
    assert math.isfinite(float(ours.sum()))
    assert error(ours.detach(), expected.detach()) < FLOAT32_TOLERANCE
    if model.config._attn_implementation == KEY_PADDING:  # transformers with mask interfaces
        assert len(given) == 2 and all(m.shape == (4, 13) and torch.equal(m, mask.bool()) for m in given)


def test_hf_decoder_mask_is_refused(bert):
    """A BERT decoder asks for a causal mask: the replaced layers apply key-padding masks only."""
    transformers = pytest.importorskip("transformers")
    from datamove.hf import KEY_PADDING, replace_bert_layers

    config = small_bert_config(transformers, attention_dropout=0.0)
    config.is_decoder = True
    model = transformers.BertModel(config).eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert replace_bert_layers(model, bert, dtype=torch.float32) == 2
        if model.config._attn_implementation != KEY_PADDING:
            pytest.skip("transformers without mask interfaces: the 4-D mask's check refuses it instead")
        with pytest.raises(ValueError, match="key-padding masks only"):
            model(input_ids=torch.randint(0, 50, (2, 9)), attention_mask=torch.ones(2, 9, dtype=torch.long))


def test_the_job_refuses_alternatives_of_a_weight_dim():
    """Alternatives of a dim the weights size, or a constant of values unknown at other sizes, are
    refused, naming what sizes it (GPT-2's T was said to size the weights; it is now a call dim)."""
    from datamove.job import shapes_of

    fused = stored_fused()["bert"].with_dims(BERT_DIMS)
    interface = tensor_interface(fused.graph, spec_module("bert").TORCH_ORDER)
    with pytest.raises(SpecError, match="--dims: N take\\(s\\) several values, but only B, L may"):
        shapes_of(fused, [{"N": 32}, {"N": 48}], interface)
    labels = list(shapes_of(fused, [{"L": 23}, {"L": 9}], interface))
    assert labels == ["B=3, L=23", "B=3, L=9"]
    gpt2 = stored_fused()["gpt2"].with_dims(GPT2_DIMS)  # its causal mask is known at any T: it was refused
    assert list(shapes_of(gpt2, [{"T": 21}, {"T": 32}], tensor_interface(gpt2.graph))) == ["B=2, T=21", "B=2, T=32"]
    from datamove.dataflow.analysis_cache import cached_analysis

    llama = cached_analysis("configs/llama.py", {}, {}).fused  # its rotary tables not declared position tables
    with pytest.raises(SpecError) as refused:
        shapes_of(llama, [{"T": 8}, {"T": 16}], tensor_interface(llama.graph))
    assert str(refused.value) == ("--dims: T take(s) several values, but only B may (the sizes a call chooses); T sizes "
                                  "the constant cos: run optimize-layer once per value (docs/runtime.md, Variable "
                                  "lengths)")


def _untuned_calls(layer, lengths, batch: int = 2) -> list[torch.Tensor]:
    """Forward and backward (evaluation mode) at ``batch`` x each of ``lengths``: each call's output and
    input gradient, on inputs drawn from one seed per length."""
    results = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for length in lengths:
            gen = torch.Generator().manual_seed(length)
            x = torch.randn(batch, length, layer.graph.size("i"), generator=gen, requires_grad=True)
            y = layer(x)
            y.backward(torch.randn(y.shape, generator=gen))
            results += [y.detach(), x.grad]
    return results


def test_a_layer_called_at_many_lengths_keeps_a_bounded_number_of_programs(bert, monkeypatch):
    """A collator padding each batch to its longest makes a shape per length: the layer keeps at
    most ``PROGRAMS_KEPT`` programs (they were kept per shape for the process, in the layer and in
    the custom ops' registry), the least recently used let go and freed; a shape whose program was
    let go runs a new one with the same results, which equal HF's."""
    import gc
    import weakref

    from datamove.export import load_weights
    from datamove.runtime import module

    monkeypatch.setattr(module, "PROGRAMS_KEPT", 3)
    reference = hf_layer(BERT_DIMS)
    layer = load(bert, "torch")
    load_weights(layer, reference).eval()
    first = _untuned_calls(layer, [7, 30, 23, 11, 5])
    assert len(layer._programs) == 3
    made = {length: weakref.ref(layer.program(False, {"B": 2, "L": length})) for length in (23, 11, 5)}
    _untuned_calls(layer, [23])  # used: kept while 9 and 40 come in
    _untuned_calls(layer, [9, 40])
    gc.collect()
    assert made[23]() is not None and made[11]() is None and made[5]() is None
    assert len(module.PROGRAMS) == len([p for p in module.PROGRAMS.values() if p.graph.dim_values["B"] != 2]) + 3
    again = _untuned_calls(layer, [7, 30, 23, 11, 5])
    for ours, before in zip(again, first):
        assert torch.equal(ours, before)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        compare_with_hf(layer, reference, 2, 7)


def test_let_go_programs_free_their_kernels(bert, monkeypatch):
    """With the plan's kernels, a program let go frees its compiled operators (each holds its graph and
    its scratch buffers; the compile cache held them for the process)."""
    import gc
    import weakref

    from datamove.kernels.codegen import compiled
    from datamove.runtime import module

    monkeypatch.setattr(module, "PROGRAMS_KEPT", 2)
    layer = load(bert)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        first = layer.program(True, {"B": 2, "L": 7})
    operators = [weakref.ref(s.compiled) for s in first.forward_steps + first.backward_steps if hasattr(s, "compiled")]
    assert operators and all(op() is not None for op in operators)
    held = len(compiled._compiled)
    del first
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for length in (8, 9, 10):
            layer.program(True, {"B": 2, "L": length})
    gc.collect()
    assert all(op() is None for op in operators)
    assert len(compiled._compiled) <= held + (module.PROGRAMS_KEPT - 1) * len(operators)  # the 2 kept programs'


def test_programs_named_by_the_custom_ops_are_kept(bert, monkeypatch):
    """A meta-device call (and a compiled graph) runs its program through the custom ops, which find
    it by name at its backward or a later call: it is kept whatever other shapes come after.  A copy
    of the layer keeps none of its programs (``TunedLayer.__getstate__``): it makes and keeps its own,
    under names of its own."""
    import copy

    from datamove.runtime import module

    monkeypatch.setattr(module, "PROGRAMS_KEPT", 1)
    layer = copy.deepcopy(load(bert, "torch")).to("meta").train()
    x = torch.randn(2, 9, layer.graph.size("i"), device="meta", requires_grad=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        y = layer(x)
        named = layer._last_call[2]
        for length in (5, 6, 7):
            layer(torch.randn(2, length, layer.graph.size("i"), device="meta"))
        y.sum().backward()  # finds its program by name
        assert module.PROGRAMS[named.name] is named and x.grad.shape == x.shape
        twin = copy.deepcopy(layer)
        assert len(twin._programs) == 0
        y = twin(torch.randn(2, 9, layer.graph.size("i"), device="meta", requires_grad=True))
        for length in (5, 6):
            twin(torch.randn(2, length, layer.graph.size("i"), device="meta"))
        y.sum().backward()
    kept = twin._programs.get(next(k for k, p in layer._programs._pinned.items() if p is named))
    assert module.PROGRAMS[kept.name] is kept and kept is not named and module.PROGRAMS[named.name] is named


def test_untuned_shapes_are_warned_about_up_to_a_number(bert, monkeypatch):
    """One warning per shape without a plan of its own, saying how to train with many lengths, for the
    first ``WARNED_SHAPES`` shapes only (a collator padding to each batch's longest warned once per length)."""
    from datamove.runtime import module

    monkeypatch.setattr(module, "WARNED_SHAPES", 2)
    layer = load(bert, "torch").eval()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for length in (5, 6, 5, 7, 8):
            layer(torch.randn(3, length, layer.graph.size("i")))
    messages = [str(w.message) for w in caught]
    assert len(messages) == 2, messages
    assert messages[0].startswith("datamove: B=3, L=5 has no plan of its own (tuned: B=3, L=23)")
    assert "pad them to a multiple of 64 (HF's DataCollatorWithPadding(pad_to_multiple_of=64))" in messages[0]
    assert "optimize-layer --dims 'L=128|256|512'" in messages[0]
    assert messages[1].endswith("; further shapes without a plan of their own are not warned about")


def test_calls_past_the_graphed_shapes_are_not_counted(bert):
    """Once a layer keeps the CUDA graphs of ``GRAPHED_SHAPES`` shapes, calls at other shapes launch
    plainly and are not counted (a count per shape was kept for every length seen)."""
    from datamove.runtime.module import GRAPHED_SHAPES

    layer = load(bert, "torch")
    for length in range(1, GRAPHED_SHAPES + 1):
        assert not layer._graphed_shape({"B": 2, "L": length}) and layer._graphed_shape({"B": 2, "L": length})
    assert all(not layer._graphed_shape({"B": 2, "L": length}) for length in range(50, 60))
    assert len(layer._calls) == GRAPHED_SHAPES


def test_the_jobs_tuning_branch_tunes_each_shape_and_selects_on_its_records(tmp_path, monkeypatch, capsys):
    """The main job on a GPU, with what needs one (device facts, ceilings, the sweeps) replaced by
    recording stand-ins: each shape's layout spaces are built on its own graph and tuned, the timings are read back from the
    database after each sweep and before each selection round, and the summary names every tuning."""
    import dataclasses
    import json

    import datamove.harness.bench as bench
    import datamove.kernels.device as device
    import datamove.kernels.interpreter as interpreter
    import datamove.tuning as tuning
    from datamove.cli import main
    from datamove.harness.tuning_db import Ceilings, TuningDB

    facts = device.DeviceFacts(**{f.name: 1 for f in dataclasses.fields(device.DeviceFacts)}
                               | {"name": "NVIDIA H100 80GB HBM3", "compute_capability": (9, 0)})
    monkeypatch.setattr(device, "query_device", lambda index=0: facts)
    monkeypatch.setattr(interpreter, "interpreted", lambda: False)
    monkeypatch.setattr(bench, "measure_ceilings", lambda db: Ceilings(facts.name, 3e12, 8e14, {}, {}, 0.0))
    tuned, queries, tuners = [], [], []

    class Pools:  # the worker processes, started before the analysis
        def __init__(self, gpus=None):
            self.events = []

        def start(self):
            self.events.append("started")
            return self

        def close(self):
            self.events.append("closed")

    class Tuner:
        def __init__(self, db, **options):
            self.gpus, self.report, self.closed, self.pools = 1, tuning.TuningReport(), False, options["pools"]
            tuners.append(self)

        def close(self):
            self.closed = True

    def tune(tuner, fused, spaces, *, spec, dtype, attention, exhaustive):
        assert exhaustive is False  # the job's default
        assert spaces and all(set(space.op.name.split("+")) <= {op.name for op in fused.operators} for space in spaces)
        tuned.append((dict(fused.graph.dim_values), dtype, len(attention)))
        return tuning.TuningReport({"measured": 3}, 1.5, None)

    query = TuningDB.query
    monkeypatch.setattr(TuningDB, "query", lambda self, **kw: queries.append(kw) or query(self, **kw))
    monkeypatch.setattr(tuning, "Tuner", Tuner)
    monkeypatch.setattr(tuning, "tuning_pools", Pools)
    monkeypatch.setattr(tuning, "tune", tune)
    monkeypatch.setattr(tuning, "tune_chosen", lambda tuner, spaces, plan: 0)
    monkeypatch.setattr(tuning, "measure_layout_changes", lambda tuner, graph, wanted, dtype: 0)
    monkeypatch.setattr(tuning, "tune_chosen_gemms", lambda tuner, fused, plan, dtype: 0)
    dims = ",".join(f"{k}={v}" for k, v in SMALL.items())
    out = tmp_path / "bert"
    assert main(["configs/bert.py", "--dims", dims + ",L=64|32", "--out", str(out), "--db", str(tmp_path / "t.db")]) == 0
    assert [(d["L"], dtype) for d, dtype, _ in tuned] == [(64, torch.bfloat16), (32, torch.bfloat16)]
    assert [t.closed for t in tuners] == [True]  # the sweeps' worker processes ended with the tuning
    assert tuners[0].pools.events[:1] == ["started"] and tuners[0].pools.events[-1] == "closed"  # and with the job
    assert all(n > 0 for _, _, n in tuned)  # the fused attention's setups go to each sweep
    assert len(queries) >= 4 and all(q["device"] == facts.name and q["dtype"] == "bfloat16" for q in queries)
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["device"]["measured"] and [s["dims"]["L"] for s in manifest["shapes"]] == [64, 32]
    assert capsys.readouterr().out.count("Tuning: 3 measured in 2 s") == 2
