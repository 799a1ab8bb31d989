"""Decoders (GPT-2, Llama) called at other sequence lengths than they were tuned at
(``datamove.runtime.call_constants``): the layer alone against the float64 executor at the call's
length, output and every gradient, through the Triton interpreter (kernels) and in PyTorch
operations (torch), shorter (odd, 1) and, where the constants allow, longer; the constants over T
read at the call's length (a causal mask at its value there, the rotary tables' leading rows, a
view or a copy into the plan's layout); a longer call than the tables hold refused in one line;
an artifact tuned at two lengths (``--dims 'T=..|..'``).  It was refused: pad every batch to T.
"""
import json
import warnings

import numpy as np
import pytest
import torch

from datamove.dataflow.executor import execute
from datamove.dataflow.initial_values import initial_values
from datamove.dataflow.snapshot import stored_fused
from datamove.runtime.call_constants import ConstantsAtCall
from datamove.runtime.layer import tensor_interface
from datamove.runtime.module import TunedLayer
from plans import selected_plan, spec_module, spec_order_plan
from test_export import FLOAT32_TOLERANCE, GPT2_DIMS, error, load, randomize, write
from test_llama_gqa import job, set_constants

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="float32 through the Triton interpreter (CPU)")
LLAMA = dict(B=2, T=13, D=48, H=6, KV=2, E=16, F=40)


def at_length(layer, length: int):
    """The layer's graph at sequence length ``length``."""
    return layer.graph.with_dims({**layer.graph.dim_values, "T": length})


def check_at_length(layer, length: int, seed: int, p: float | None = None, tolerance: float = FLOAT32_TOLERANCE) -> None:
    """Forward + backward of ``layer`` on x [B, ``length``, D] against the float64 executor on its
    graph at that length (``p=0.0``: the layer in evaluation mode), the constants as a call there
    reads them: a position table's leading rows, the others their values at that length."""
    face, graph = layer.interface, at_length(layer, length)
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(layer.graph.size("b"), length, layer.graph.size("d"), generator=gen)
    x = x.to(layer.device_).requires_grad_()
    torch.manual_seed(seed)
    drawn = int(torch.randint(0, 2**31 - 1, (1,)).item())
    torch.manual_seed(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the untuned shape's warning
        y = layer(x)
    grad = torch.randn(y.shape, generator=gen)
    y.backward(grad.to(y.device))
    numpy = lambda t: t.detach().double().cpu().numpy()  # noqa: E731
    values = {t: numpy(layer.spec_view(t)) for t in face.parameters}
    kinds = initial_values(graph, (), face.constants)
    for t in face.constants:
        values[t] = (numpy(layer.spec_view(t)[tuple(slice(0, graph.size(x)) for x in graph.tensors[t].letters)])
                     if t in face.positions else kinds[t].array(graph, t))
    values["x"], values["d_y"] = numpy(x), numpy(grad)
    env = execute(graph, values, seed=drawn, p=p)
    assert y.shape == x.shape
    assert error(numpy(y), env["y"]) < tolerance, f"forward at T={length}"
    assert error(numpy(x.grad), env["d_x"]) < tolerance, f"gradient of x at T={length}"
    largest = max(np.linalg.norm(env[g]) for g in face.input_grads.values())
    for t, param in layer.named_parameters():
        assert error(numpy(layer.spec_view(t, param.grad)), env[f"d_{t}"], largest) < tolerance, \
            f"gradient of {t} at T={length}"
        param.grad = None


@pytest.mark.parametrize("plan_for, backend", [(selected_plan, "kernels"), (selected_plan, "torch"),
                                               (spec_order_plan, "torch")],
                         ids=["selected-kernels", "selected-torch", "spec-order-torch"])
def test_gpt2_runs_any_length_with_dropout(tmp_path, plan_for, backend):
    """GPT-2 tuned at T=21 (the selected plan's fused attention applies the causal mask itself, its
    kernels never load the constant; the torch backend, and the spec-order plan, not written as its
    kernels cannot run, add the constant as the spec does): at T=8, 1 and 30, training mode
    (dropout), and back at T=21; its causal mask at each length is the causal mask there."""
    if plan_for is selected_plan:
        layer = load(write(tmp_path, "gpt2", GPT2_DIMS, plan_for), backend=backend)
    else:
        fused = stored_fused()["gpt2"].with_dims(GPT2_DIMS)
        interface = tensor_interface(fused.graph, getattr(spec_module("gpt2"), "TORCH_ORDER", {}))
        layer = TunedLayer(spec_order_plan(fused, "gpt2"), fused.graph, fused.operators, interface, torch.float32,
                           "cpu", backend=backend)
    assert layer.call_dims == ("B", "T") and layer.call_limits == {}
    randomize(layer, 1)
    for n, length in enumerate((8, 1, 30, 21)):
        check_at_length(layer, length, seed=n)
    assert layer.program(True, {"B": 2, "T": 21}).at_call is None  # the tuned length reads the held mask as before
    longer = layer.program(True, {"B": 2, "T": 30})  # no [30, 30] mask made where the fused attention applies its own
    assert (longer.at_call is None) == (longer.causal_constants == ["causal"])


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return job(tmp_path_factory.mktemp("llama_lengths") / "out", dims=",".join(f"{k}={v}" for k, v in LLAMA.items()))


@pytest.mark.parametrize("backend", ["kernels", "torch"])
def test_llama_runs_shorter_lengths_and_refuses_longer(llama, backend):
    """Llama tuned at T=13, its rotary tables stored over (e, s) (a slice of the leading positions is
    copied into the program's layout): at T=6, 1 and 13 against the executor with the tables'
    leading rows; T=14 has no positions to read and is refused in one line."""
    layer = load(llama, backend=backend, allow_mismatch=True)
    assert layer.plan.layouts["cos"] == "es" and layer.interface.positions == ("cos", "sin")
    randomize(layer, 2)
    set_constants(layer)
    for n, length in enumerate((6, 1, 13)):
        check_at_length(layer, length, seed=n)
    with pytest.raises(ValueError, match=r"^x: T=14, longer than the 13 positions of the layer's position tables \(cos, "
                                         r"sin, for positions 0..12\): truncate to T=13, or tune the layer at your longest "
                                         r"length \(optimize-layer --dims T=...\), which runs every shorter one"):
        layer(torch.randn(2, 14, 48))


def test_a_slice_of_a_position_table_is_read_in_place_where_its_layout_allows(llama):
    """Stored over (s, e) the leading rows are the program's layout at the shorter length: read in
    place; over (e, s) they are strided: copied into the layout, which the generated kernels read."""
    layer = load(llama, allow_mismatch=True)
    set_constants(layer)
    graph = at_length(layer, 5)
    for layout, in_place in (("es", False), ("se", True)):
        values = layer.spec_view("cos").detach()  # over (s, e)
        held = values.contiguous() if layout == "se" else values.t().contiguous().t()  # stored in layout
        at_call = ConstantsAtCall(graph, layer.interface, layer.graph.dim_values, {**layer.plan.layouts, "cos": layout},
                                  torch.float32, "cpu", dense=True)
        read = at_call.take({"cos": held, "sin": layer.spec_view("sin")})["cos"]
        assert torch.equal(read, held[:5]) and (read.data_ptr() == held.data_ptr()) == in_place, layout
        strides = {"se": (16, 1), "es": (1, 5)}[layout]
        assert read.stride() == strides, layout
    assert set(at_call.known) == {"causal"} and float(at_call.known["causal"][0, 1]) < -1e3


def test_position_tables_set_in_part_and_checked_where_read(llama):
    """``set_constant`` takes a position table for fewer positions (HF's tables of a shorter batch):
    its leading rows set, a call at that length runs; the rows after stay unset (NaN), so a call
    reading them is refused, naming the table."""
    layer = load(llama, backend="torch", allow_mismatch=True)
    randomize(layer, 3)
    set_constants(layer)
    for name in ("cos", "sin"):
        layer.spec_view(name).fill_(float("nan"))
        layer.set_constant(name, torch.rand(7, 16))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert torch.isfinite(layer(torch.randn(2, 7, 48))).all()
        with pytest.raises(ValueError, match=r"constant\(s\) not set: 'cos' \(over s, e: \(9, 16\)\); 'sin'"):
            layer(torch.randn(2, 9, 48))
    for shape in ((14, 16), (7, 8)):
        with pytest.raises(ValueError, match=rf"set_constant\('cos'\): a tensor of shape \({shape[0]}, {shape[1]}\); cos "
                                             r"is over s, e: \(13, 16\) \(a position table: or fewer positions along s"):
            layer.set_constant("cos", torch.rand(*shape))


def test_an_artifact_tuned_at_two_lengths_dispatches_and_holds_the_longest_tables(tmp_path):
    """``--dims 'T=7|13'`` (it was refused: T sizes a constant): one plan per length, the tables held
    for the longest (13 positions, though the first plan is T=7's), each length running its own
    plan and a length between the next larger one, against the executor."""
    dims = ",".join(f"{k}={v}" for k, v in LLAMA.items() if k != "T") + ",T=7|13"
    out = job(tmp_path / "out", dims=dims)
    assert [s["dims"] for s in json.loads((out / "manifest.json").read_text())["shapes"]] == \
        [{"B": 2, "T": 7}, {"B": 2, "T": 13}]
    layer = load(out, backend="kernels", allow_mismatch=True)
    assert tuple(layer.spec_view("cos").shape) == (13, 16) and layer.call_limits == {"T": (13, ["cos", "sin"])}
    randomize(layer, 4)
    set_constants(layer)
    for n, (length, tuned) in enumerate(((7, 0), (13, 1), (10, 1))):
        assert layer.dispatch({"B": 2, "T": length}) is layer.plans[tuned]
        check_at_length(layer, length, seed=n)


def test_tables_not_declared_position_tables_keep_the_length_fixed(llama, tmp_path):
    """An artifact whose spec declares no POSITION_TABLES (written before they existed): its rotary
    tables' values at other lengths are unknown, so T stays fixed and a shorter call is refused in
    one line saying what to do, the declaration included."""
    import shutil

    old = tmp_path / "old"
    shutil.copytree(llama, old)
    manifest = json.loads((old / "manifest.json").read_text())
    del manifest["position_tables"]
    (old / "manifest.json").write_text(json.dumps(manifest))
    layer = load(old, backend="torch", allow_mismatch=True)
    assert layer.call_dims == ("B",) and layer.interface.positions == ()
    set_constants(layer)
    with pytest.raises(ValueError, match=r"^x: shape \(2, 6, 48\), expected \(B, 13, 48\) \(b, s, d\): B any size >= 1; "
                                         r"the other sizes are fixed by the layer's tensors \(T by cos, .*\); T is the "
                                         r"sequence length the layer was tuned at \(cos is a constant over it whose "
                                         r"values at other lengths the layer cannot know; if its entries along T are "
                                         r"positions 0, 1, ..., name it in the spec's POSITION_TABLES and run "
                                         r"optimize-layer again: any shorter T then runs\): pad every batch to T=13 "):
        layer(torch.randn(2, 6, 48))


def test_fsdp2s_static_copies_hold_the_constants_at_the_layers_length(llama):
    """Under FSDP2 a program's graphs read static copies of the parameters and constants, into which
    each replay copies its call's (``runtime.graphs.SharedStatics``): a program at a shorter length
    holds its rotary tables at the layer's 13 positions (as the layer does: the copy in failed on
    their shapes, the statics sized at the call's), and reads their leading rows."""
    from datamove.runtime.graphs import SharedStatics

    layer = load(llama, backend="kernels", allow_mismatch=True)
    set_constants(layer)
    program = layer.program(True, {"B": 2, "T": 6})
    statics = SharedStatics(program)
    sizes = dict(zip(layer.interface.parameters + layer.interface.constants, (tuple(t.shape) for t in statics.tensors)))
    assert sizes["cos"] == sizes["sin"] == (13, 16) and sizes["causal"] == (13, 13)
    statics.copy_in(layer._spec_tensors(layer._held()))
    assert torch.equal(dict(zip(layer.interface.constants, statics.tensors[-len(layer.interface.constants):]))["cos"],
                       layer.spec_view("cos"))


def test_layers_that_ran_their_kernels_are_saved_whole_and_compute_right(llama):
    """``torch.save`` of a layer that had run its kernels (so of any model trained with them: a
    GPU's default) failed with "PicklingError: Can't pickle <function ..._kernel>": its programs'
    launchers hold the generated kernels, functions of modules made in the process.  A layer now
    pickles without the programs (and CUDA graphs) it made: a loaded layer and its sibling, still
    sharing one program cache, make their own on their first calls, at T=13 and 6 against the
    float64 executor (output and every gradient); ``copy.deepcopy`` alike."""
    import copy
    import io

    layer = load(llama, backend="kernels", allow_mismatch=True)
    twin = layer.sibling()
    for n, each in enumerate((layer, twin)):
        randomize(each, 5 + n)
        set_constants(each, 5 + n)
        check_at_length(each, 6, seed=n)
    assert len(layer._programs) == 1  # the siblings' one program at B=2, T=6
    saved = io.BytesIO()
    torch.save([layer, twin], saved)
    saved.seek(0)
    loaded, loaded_twin = torch.load(saved, weights_only=False)
    assert loaded._programs is loaded_twin._programs and len(loaded._programs) == 0
    for each in (loaded, loaded_twin, copy.deepcopy(twin)):
        for n, length in enumerate((13, 6)):
            check_at_length(each, length, seed=n)
