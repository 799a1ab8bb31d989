"""Generated element-wise / normalization kernels (kernels.codegen) and their layout spaces.

Every non-contraction forward operator of BERT and GPT-2, at small odd dims through the Triton
interpreter, in the spec layouts and in a permuted configuration, against a float64 evaluation
of the operator's primitives; dropout masks regenerated with ``dropout_scale_mask``; bf16 judged
by ``harness.accuracy`` against PyTorch eager bf16 of the same primitives.  Graphs come from the
stored snapshot (no DaCe on the GPU machine), checked against the live front end here.
"""
import functools
import math

import pytest
import torch

from datamove.dataflow.expression import ARITY, FUNCTIONS
from datamove.harness.accuracy import assert_closer
from datamove.kernels.codegen import allocate, compile_operator, generate_source
from datamove.kernels.codegen.compiled import load_module
from datamove.kernels.codegen.expressions import triton_expression
from datamove.kernels.codegen.source import PRELUDE, with_called_helpers
from datamove.layouts.space import (Configuration, configurations, default_configuration, knob_choices, operator_letters,
                           tile_axes)
from datamove.dataflow.dropout_mask import dropout_scale_mask
from datamove.dataflow import snapshot

SMALL = {"bert": dict(B=2, L=5, N=12, H=3, P=4, U=7), "gpt2": dict(B=2, T=5, D=12, H=3, E=4, F=7)}
GRAPHS = snapshot.stored()


def _setup(spec: str, dims=None):
    graph, ops = GRAPHS[spec]
    graph = graph.with_dims(dims or SMALL[spec])
    return graph, {op.name: op for op in ops if op.cls != "contraction"}


CASES = [(spec, name) for spec in ("bert", "gpt2") for name in _setup(spec)[1]]


# --- reference: the operator's primitives evaluated eagerly (float64 reference, bf16 baseline) ---

def _align(value: torch.Tensor, letters: str, target: str) -> torch.Tensor:
    """``value`` over ``letters`` permuted and unsqueezed to broadcast over ``target``."""
    order = [l for l in target if l in letters]
    value = value.permute([letters.index(l) for l in order])
    return value.reshape([value.shape[order.index(l)] if l in letters else 1 for l in target])


def evaluate(graph, op, inputs: dict, dtype) -> dict:
    """{tensor: value in spec order} for every tensor the primitives produce, eagerly in ``dtype``."""
    values = {t: x.to(dtype) for t, x in inputs.items()}
    as_t = lambda a: a if isinstance(a, torch.Tensor) else torch.tensor(a, dtype=dtype)
    functions = {"exp": torch.exp, "log": torch.log, "sqrt": lambda a: torch.sqrt(as_t(a)), "tanh": torch.tanh,
                 "abs": torch.abs, "maximum": lambda a, b: torch.maximum(as_t(a), as_t(b)),
                 "minimum": lambda a, b: torch.minimum(as_t(a), as_t(b)), "where": torch.where}
    for prim in op.primitives:
        out = prim.output.letters
        if prim.kind == "map":
            args = [_align(values[o.tensor], o.letters, out) for o in prim.inputs]
            result = prim.expression.evaluate(args, graph.scalars(), functions)
            shape = [graph.dim_values[graph.letter_dims[l]] for l in graph.tensors[prim.output.tensor].letters]
            values[prim.output.tensor] = torch.broadcast_to(as_t(result), shape).to(dtype)
        else:
            src = prim.inputs[0].letters
            axes = [n for n, l in enumerate(src) if l not in out]
            x = values[prim.inputs[0].tensor]
            red = x.sum(dim=axes) if prim.expr == "sum" else x.amax(dim=axes)
            kept = [l for l in src if l in out]
            values[prim.output.tensor] = red.permute([kept.index(l) for l in out])
    return values


@functools.lru_cache(maxsize=8)
def _mask(seed: int, offset: int, shape: tuple, p: float) -> torch.Tensor:
    return torch.from_numpy(dropout_scale_mask(seed, offset, shape, p))


def _inputs(graph, op, seed=0):
    """Random inputs (spec order, float64; x ~ N(0,1), no zeros) and dropout (seed, offset) per mask."""
    gen = torch.Generator().manual_seed(seed)
    values, seeds = {}, {}
    for n, t in enumerate(op.inputs):
        info = graph.tensors[t]
        shape = [graph.dim_values[graph.letter_dims[l]] for l in info.letters]
        if info.role == "dropout":
            seeds[t] = (1234 + n, 64 * (77 * n + 5))  # masks start a group of 64 counters (dataflow.executor.dropout_offsets)
            values[t] = _mask(*seeds[t], tuple(shape), info.p)
        else:
            values[t] = torch.randn(shape, generator=gen, dtype=torch.float64) + 0.1
    return values, seeds


def _check(graph, op, config, dtype=torch.float32, seed=0):
    values, seeds = _inputs(graph, op, seed)
    compiled = compile_operator(graph, op, config)
    tensors = {}
    for t in compiled.plan.loads:
        tensors[t] = allocate(graph, t, config.layouts[t], dtype)
        tensors[t].copy_(values[t])
    out = compiled.run(tensors, seeds)
    reference = evaluate(graph, op, values, torch.float64)
    baseline = evaluate(graph, op, {t: v.to(dtype) for t, v in values.items()}, dtype)
    for t in op.outputs:
        assert out[t].dtype == dtype
        storage_order = sorted(range(out[t].dim()), key=lambda a: -out[t].stride(a))
        assert "".join(graph.tensors[t].letters[a] for a in storage_order) == config.layouts[t]
        if dtype == torch.float32:
            torch.testing.assert_close(out[t].double(), reference[t], rtol=2e-5, atol=2e-5, msg=f"{op.name}:{t}")
        else:
            assert_closer(out[t], baseline[t], reference[t], what=f"{op.name}:{t} {config.key()}")
    return compiled


def _permuted(graph, op) -> Configuration:
    """A configuration whose layouts differ most from the spec order, another vector letter if any."""
    default = default_configuration(graph, op)
    configs = configurations(graph, op)
    moved = lambda c: sum(c.layouts[t] != graph.tensors[t].letters for t in c.layouts)
    return max(configs, key=lambda c: (c.knobs["vector"] != default.knobs["vector"], moved(c)))


# --- correctness ----------------------------------------------------------------------------

@pytest.mark.parametrize("spec,name", CASES)
def test_spec_layouts_fp32(spec, name):
    graph, ops = _setup(spec)
    _check(graph, ops[name], default_configuration(graph, ops[name]))


@pytest.mark.parametrize("spec,name", CASES)
def test_permuted_layouts_fp32(spec, name):
    graph, ops = _setup(spec)
    config = _permuted(graph, ops[name])
    assert any(config.layouts[t] != graph.tensors[t].letters for t in config.layouts if len(config.layouts[t]) > 1)
    _check(graph, ops[name], config, seed=1)


@pytest.mark.parametrize("spec,name", CASES)
def test_bf16(spec, name):
    graph, ops = _setup(spec)
    _check(graph, ops[name], _permuted(graph, ops[name]), torch.bfloat16, seed=2)


NORMS = [(s, n) for s, n in CASES if _setup(s)[1][n].cls == "normalization"]


@pytest.mark.parametrize("spec,name", NORMS)
def test_loop_over_chunks(spec, name):
    """mode "loop" with chunks smaller than the reduction: chained reductions in several passes."""
    graph, ops = _setup(spec)
    base = default_configuration(graph, ops[name])
    config = Configuration(base.layouts, {**base.knobs, "mode": "loop", "block_col": 4, "block_row": 2})
    source = _check(graph, ops[name], config, seed=3).source
    assert source.count("for start in range(0, n_cols, BLOCK_COL)") == 3  # 2 chained reductions + outputs


@pytest.mark.parametrize("spec,name", NORMS)
@pytest.mark.parametrize("mode", ["row", "loop"])
def test_vector_letter_not_reduced(spec, name, mode):
    """The exhaustive group: vectorised along an independent letter, reduced along tile rows."""
    graph, ops = _setup(spec)
    letters = operator_letters(graph, ops[name])
    vector = letters.independent[-1]
    order = "".join(l for l in letters.letters if l != vector) + vector
    knobs = next(k for k in knob_choices(graph, letters, vector, order, exhaustive=True) if k["mode"] == "row")
    if mode == "loop":
        knobs = {**knobs, "mode": "loop", "block_row": 4}
    layouts = {t: graph.tensors[t].letters[::-1] for t in list(ops[name].inputs) + list(ops[name].outputs)}
    _check(graph, ops[name], Configuration(layouts, knobs), seed=4)


def test_stored_dropout_mask():
    """knob dropout="load": the mask is read from memory instead of regenerated."""
    graph, ops = _setup("bert")
    op = ops["alpha"]
    base = default_configuration(graph, op)
    config = Configuration({**base.layouts}, {**base.knobs, "dropout": "load"})
    compiled = _check(graph, op, config)
    assert "dropout_keep(" not in compiled.source.split("def alpha_kernel")[1]
    assert "drop_attn_ptr" in compiled.source


@pytest.mark.parametrize("length,block_col,grouped", [(192, 128, True), (72, 64, False), (64, 32, False)])
def test_dropout_grouped_in_any_storage_layout(length, block_col, grouped):
    """alpha tiled along k (its mask's last letter), every tensor stored in reversed letter order:
    sequence length 192 in blocks of 128 columns (ragged last block) takes one Philox call per sixteen
    columns; length 72 (rows not starting a group of 64 counters) or blocks of 32 columns (splitting
    groups) one per element; all the convention's mask."""
    graph, ops = _setup("bert", {**SMALL["bert"], "L": length})
    op = ops["alpha"]
    base = default_configuration(graph, op)
    layouts = {t: graph.tensors[t].letters[::-1] for t in (*op.inputs, *op.outputs)}
    source = _check(graph, op, Configuration(layouts, {**base.knobs, "block_col": block_col}), seed=5).source
    assert ("one Philox call per sixteen columns" in source) == grouped and ("dropout_keep(" in source) != grouped


@pytest.mark.parametrize("block_row,num_warps,gathered", [(16, 1, True), (4, 1, False), (16, 4, False)])
def test_dropout_grouped_along_columns_exchanges_bits_where_threads_hold_enough(block_row, num_warps, gathered):
    """A mask grouped along the tile's columns: each call drawn once and its bits exchanged
    (``unpack_gathered``) where a thread holds at least ``GATHER_ELEMENTS`` elements (16 rows x 128
    columns on one warp: 64; not 16), else each thread draws the calls it uses; the convention's mask either way."""
    graph, ops = _setup("bert", {**SMALL["bert"], "L": 192})
    op = ops["alpha"]
    base = default_configuration(graph, op)
    layouts = {t: graph.tensors[t].letters[::-1] for t in (*op.inputs, *op.outputs)}
    knobs = {**base.knobs, "block_row": block_row, "block_col": 128, "num_warps": num_warps}
    source = _check(graph, op, Configuration(layouts, knobs), seed=7).source
    assert "one Philox call per sixteen columns" in source
    assert ("unpack_gathered(keep_bits(" in source) == gathered and ("dropout_keep_grouped(" in source) != gathered


def test_source_is_readable_and_cached(tmp_path):
    graph, ops = _setup("bert")
    op = ops["x1"]
    config = default_configuration(graph, op)
    source = generate_source(graph, op, config)
    for needle in ("stride_resid1_i", "size_i", "dim_N", "tl.sum(", "layernorm_mean[bj] = layernorm_sum_x[bj] / N"):
        assert needle in source
    first = compile_operator(graph, op, config)
    assert compile_operator(graph, op, config) is first
    assert first.path.read_text() == source


_KERNEL = '''

@triton.jit
def function_kernel(in0_ptr, in1_ptr, in2_ptr, out_ptr, n, BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    in0, in1, in2 = (tl.load(p + i, mask=i < n) for p in (in0_ptr, in1_ptr, in2_ptr))
    tl.store(out_ptr + i, {expression}, mask=i < n)
'''
EXACT_NEAR_ZERO = {"log1p", "expm1"}  # relative to the value itself, not only absolutely (_tanh is not)


@pytest.mark.parametrize("function", sorted(FUNCTIONS))
def test_each_function_in_a_kernel_is_numpys(function):
    """Every function of the map language (``dataflow.expression.FUNCTIONS``) through the generated code's
    table (``kernels.codegen.expressions.FUNCTIONS``) and the jit helpers it calls, in float32: NumPy's
    float64 value to 4 float32 ulp, on values of both signs down to 1e-8 (log, sqrt: of |x| + 0.1; log1p: above
    -0.9); log1p and expm1 relative to the value itself there, where log(1 + x) and exp(x) - 1 lose every digit."""
    gen = torch.Generator().manual_seed(sorted(FUNCTIONS).index(function))
    magnitude = torch.cat([torch.logspace(-8, 0.5, 61, dtype=torch.float64), 3 * torch.rand(67, generator=gen, dtype=torch.float64)])
    x = (magnitude * torch.where(torch.rand(128, generator=gen) < 0.5, -1.0, 1.0)).float()
    x = {"log": x.abs() + 0.1, "sqrt": x.abs() + 0.1, "log1p": x.clamp(min=-0.9)}.get(function, x)
    others = [torch.randn(128, generator=gen).float() for _ in range(2)]
    text = {1: "{}(in0)", 2: "{}(in0, in1)", 3: "{}(in0 > 0, in1, in2)"}[ARITY[function]].format(function)
    module, _ = load_module(with_called_helpers(PRELUDE + _KERNEL.format(
        expression=triton_expression(text, ["in0", "in1", "in2"], {}))))
    out = torch.empty(128)
    module.function_kernel[(1,)](x, *others, out, 128, BLOCK=128)
    args = [x.double().numpy(), *(o.double().numpy() for o in others)]
    expected = FUNCTIONS[function](*([args[0] > 0, *args[1:]] if function == "where" else args[:ARITY[function]]))
    atol = 0.0 if function in EXACT_NEAR_ZERO else 2 ** -22  # two ulp of 1: _tanh's 2 sigmoid(2x) - 1 near 0
    torch.testing.assert_close(out.double(), torch.from_numpy(expected).double(), rtol=4 * 2 ** -24, atol=atol)


# --- layout spaces and pruning ----------------------------------------------------------------

@pytest.mark.parametrize("spec,name", CASES)
def test_pruned_space_follows_the_rules(spec, name):
    graph, ops = _setup(spec, {**{k: v * 64 + 1 for k, v in SMALL[spec].items()}})
    op = ops[name]
    letters = operator_letters(graph, op)
    configs = configurations(graph, op)
    assert configs and len({c.key() for c in configs}) == len(configs)
    # rule 2 dropped: every letter is some configuration's vector, a normalization's independent ones too
    assert {c.knobs["vector"] for c in configs} == set(letters.letters)
    for config in configs:
        vector = config.knobs["vector"]
        for t, layout in config.layouts.items():
            axes = letters.tensor_axes[t]
            assert sorted(layout) == sorted(graph.tensors[t].letters)
            as_op = "".join(axes[graph.tensors[t].letters.index(c)] for c in layout)
            if vector in axes:  # rule 1: the vector letter is contiguous
                assert as_op[-1] == vector
            # rule 3: one relative order of letters
            assert as_op == "".join(l for l in config.knobs["order"] if l in axes)
        k = config.knobs
        assert k["block_row"] * k["block_col"] <= 16384
        assert k["block_row"] & (k["block_row"] - 1) == 0 and k["block_col"] & (k["block_col"] - 1) == 0
        grid, rows, cols = tile_axes(letters, k)
        assert sorted(grid + rows + cols) == sorted(letters.letters)


def test_exhaustive_space_contains_the_pruned_one():
    graph, ops = _setup("bert", dict(B=8, L=65, N=129, H=3, P=5, U=7))
    op = ops["resid1"]  # three ibj tensors
    pruned, full = configurations(graph, op), configurations(graph, op, exhaustive=True)
    layout_sets = lambda cs: {tuple(sorted(c.layouts.items())) for c in cs}
    assert layout_sets(pruned) < layout_sets(full)
    assert len(layout_sets(full)) == math.factorial(3) ** 3
    assert len(layout_sets(pruned)) == 3 * 2  # vector letter x order of the two others
    norm = ops["x1"]
    assert {c.knobs["vector"] for c in configurations(graph, norm, exhaustive=True)} == set("ibj")
    assert {c.knobs["vector"] for c in configurations(graph, norm)} == set("ibj")  # rule 2 dropped


def test_fixed_layouts_and_dropout_choices():
    graph, ops = _setup("bert")
    op = ops["alpha"]
    fixed = {"probs": "bhjk"}
    configs = configurations(graph, op, fixed=fixed, dropout_choices=("regenerate", "load"))
    assert configs and all(c.layouts["probs"] == "bhjk" for c in configs)
    assert {c.knobs["dropout"] for c in configs} == {"regenerate", "load"}


def test_snapshot_matches_front_end():
    pytest.importorskip("dace")
    import json
    assert snapshot.live() == json.loads(snapshot.PATH.read_text())


# --- GPU at BERT-large / GPT-2 dims --------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("spec,name", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_full_size_gpu(spec, name, dtype):
    graph, ops = GRAPHS[spec]
    ops = {op.name: op for op in ops}
    op = ops[name]
    for config in (default_configuration(graph, op), _permuted(graph, op)):
        values, seeds = _inputs(graph, op)
        values = {t: v.cuda() for t, v in values.items()}
        compiled = compile_operator(graph, op, config)
        tensors = {}
        for t in compiled.plan.loads:
            tensors[t] = allocate(graph, t, config.layouts[t], dtype, "cuda")
            tensors[t].copy_(values[t])
        out = compiled.run(tensors, seeds)
        reference = evaluate(graph, op, values, torch.float64)
        baseline = evaluate(graph, op, {t: v.to(dtype) for t, v in values.items()}, dtype)
        for t in op.outputs:
            assert_closer(out[t], baseline[t], reference[t], factor=1.5 if dtype == torch.bfloat16 else 1.0,
                          margin=1e-4 if dtype == torch.bfloat16 else 1e-5, what=f"{name}:{t}")
