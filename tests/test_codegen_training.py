"""Generated kernels (kernels.codegen) for every fused non-contraction operator of the training graphs.

The fused training graphs of BERT and GPT-2 come from the stored snapshot
(``dataflow/snapshots/training_operators.json``, checked against the live front end where DaCe is
installed).  The reference executor runs the whole training graph at small odd dims in float64
with fixed inputs and dropout seed; each operator is fed its inputs from that run and its outputs
are compared with the executor's (fp32: tight tolerance; bf16: ``harness.accuracy`` against
PyTorch eager bf16 of the same primitives).  Dropout masks are regenerated in the kernel from
the executor's (seed, offset), so a kernel that drew another mask would fail.  Operators of
several independent parts (stacked Q/K/V bias adds and bias gradients, BERT's two FFN bias
gradients joined as the paper fuses them: ``tests/bias_join.py``) run as one launch with one program range per part.
"""
import functools

import numpy as np
import pytest
import torch

from datamove.dataflow.autodiff import build_training_graph
from datamove.dataflow.executor import dropout_offsets, execute
from datamove.dataflow.fusion import fuse
from datamove.dataflow.pipeline import forward_graph
from datamove.harness.accuracy import assert_closer
from datamove.kernels.codegen import SUM_ROWS, allocate, compile_operator
from datamove.layouts.space import (SUM_PROGRAMS, SUMS_KEPT, Configuration, column_sum_joins, combine_parts, configurations,
                                    default_configuration, knob_choices, operator_letters, parts, terminal_reductions)
from datamove.dataflow import snapshot
from tests.bias_join import joined_bias_gradients
from tests.test_codegen import evaluate

SMALL = {"bert": dict(B=2, L=5, N=12, H=3, P=4, U=7), "gpt2": dict(B=2, T=5, D=12, H=3, E=4, F=7)}
# Sequence lengths (and GPT-2's D) a multiple of 64: masks along k / t / j / d can take one Philox
# call per sixteen columns (whole groups of 64 counters); QUARTETS: multiples of 4 only, drawn per element.
GROUPED = {"bert": dict(B=2, L=64, N=12, H=2, P=4, U=7), "gpt2": dict(B=2, T=64, D=64, H=2, E=8, F=7)}
QUARTETS = {"bert": dict(B=3, L=12, N=12, H=3, P=4, U=7), "gpt2": dict(B=3, T=12, D=12, H=3, E=4, F=7)}
SEED = 7  # dropout seed of the reference run
BF16_MARGIN = 1e-4  # the bf16 rule's margin (the generated kernels round bf16 stores under the interpreter too)
GRAPHS = snapshot.stored(snapshot.TRAINING_PATH)


def _setup(spec: str, dims=None):
    graph, ops = GRAPHS[spec]
    return graph.with_dims(dims or SMALL[spec]), {op.name: op for op in ops if op.cls != "contraction"}


CASES = [(spec, name) for spec in ("bert", "gpt2") for name in _setup(spec)[1]]


# bf16 checks: wider feature dims, so that outputs reduced onto them (layernorm gammas, biases) hold
# enough elements for the error norms to compare roundings, not one flipped last bit among 12.
BF16_DIMS = {"bert": dict(B=2, L=9, N=40, H=4, P=10, U=11), "gpt2": dict(B=2, T=9, D=40, H=4, E=10, F=11)}
# 300 rows (b, j) of short features: more programs' column sums than one load of the sums kernel holds
MANY_ROWS = {"bert": dict(B=3, L=100, N=12, H=3, P=4, U=7), "gpt2": dict(B=3, T=100, D=12, H=3, E=4, F=7)}
DIMS = {"small": SMALL, "grouped": GROUPED, "quartets": QUARTETS, "bf16": BF16_DIMS, "many_rows": MANY_ROWS}


@functools.lru_cache(maxsize=8)
def _reference(spec: str, dims: str = "small") -> dict:
    """Every tensor of the fused training graph at ``DIMS[dims]``, float64 (inputs N(0,1) + 0.1)."""
    graph, _ = _setup(spec, DIMS[dims][spec])
    rng = np.random.default_rng(0)
    values = {n: rng.standard_normal([graph.size(l) for l in t.letters]) + 0.1
              for n, t in graph.tensors.items() if t.role in ("input", "constant", "grad_output")}
    return execute(graph, values, seed=SEED)


def _check(spec, name, config, dtype=torch.float32, dims: str = "small"):
    graph, ops = _setup(spec, DIMS[dims][spec])
    return _check_operator(graph, ops[name], _reference(spec, dims), config, dtype)


def _check_operator(graph, op, env, config, dtype=torch.float32):
    """Run ``op`` compiled under ``config`` on its inputs from ``env`` (the executor's run) and compare."""
    name, offsets = op.name, dropout_offsets(graph)
    compiled = compile_operator(graph, op, config)
    tensors = {}
    for t in compiled.loads:
        tensors[t] = allocate(graph, t, config.layouts[t], dtype)
        tensors[t].copy_(torch.from_numpy(env[t]))
    seeds = {t: (SEED, offsets[t]) for t in op.inputs if graph.tensors[t].role == "dropout"}
    out = compiled.run(tensors, seeds)
    assert sorted(out) == sorted(op.outputs)
    baseline = None
    if dtype != torch.float32:
        baseline = evaluate(graph, op, {t: torch.from_numpy(env[t]).to(dtype) for t in op.inputs}, dtype)
    for t in op.outputs:
        assert out[t].dtype == dtype
        storage_order = sorted(range(out[t].dim()), key=lambda a: -out[t].stride(a))
        assert "".join(graph.tensors[t].letters[a] for a in storage_order) == config.layouts[t]
        reference = torch.from_numpy(env[t])
        if dtype == torch.float32:
            torch.testing.assert_close(out[t].double(), reference, rtol=2e-5, atol=2e-5, msg=f"{name}:{t}")
        else:
            assert_closer(out[t], baseline[t], reference, margin=BF16_MARGIN, what=f"{name}:{t} {config.key()}")
    return compiled


def _moved(graph, config) -> int:
    return sum(config.layouts[t] != graph.tensors[t].letters for t in config.layouts)


def _permuted_single(graph, op) -> Configuration:
    default = default_configuration(graph, op)
    return max(configurations(graph, op),
               key=lambda c: (c.knobs["vector"] != default.knobs["vector"], _moved(graph, c)))


def _permuted(graph, op) -> Configuration:
    """Layouts most unlike the spec order (another vector letter where there is one), every part."""
    split = parts(op)
    if len(split) == 1:
        return _permuted_single(graph, op)
    return combine_parts([_permuted_single(graph, part) for part in split], 2, "regenerate")


# --- correctness against the reference executor ------------------------------------------------

@pytest.mark.parametrize("spec,name", CASES)
def test_default_fp32(spec, name):
    graph, ops = _setup(spec)
    _check(spec, name, default_configuration(graph, ops[name]))


@pytest.mark.parametrize("spec,name", CASES)
def test_permuted_fp32(spec, name):
    graph, ops = _setup(spec)
    config = _permuted(graph, ops[name])
    assert any(config.layouts[t] != graph.tensors[t].letters for t in config.layouts if len(config.layouts[t]) > 1)
    _check(spec, name, config)


def _configured(graph, op, loop_chunk: int | None = None, block_col: int | None = None, loop_rows: int = 2,
                row_rows: int | None = None) -> Configuration:
    """The default configuration of every part; with ``loop_chunk`` each reducing part in mode
    "loop" over chunks of that many columns (``loop_rows`` rows), else with ``row_rows`` each part
    that reduces along its tile's columns in whole rows, that many rows per block; with
    ``block_col`` each element-wise part's BLOCK_COL set."""
    split = parts(op)
    chosen = []
    for part in split:
        config = default_configuration(graph, part)
        reduced = operator_letters(graph, part).reduced
        reduces = bool(reduced)
        if reduces and loop_chunk:
            config = Configuration(config.layouts, {**config.knobs, "mode": "loop", "block_col": loop_chunk, "block_row": loop_rows})
        elif row_rows and config.knobs["vector"] in reduced:
            config = Configuration(config.layouts, {**config.knobs, "block_row": row_rows})
        if not reduces and block_col:
            config = Configuration(config.layouts, {**config.knobs, "block_col": block_col})
        chosen.append(config)
    return chosen[0] if len(split) == 1 else combine_parts(chosen, 4, "regenerate")


def _loop(graph, op) -> Configuration:
    """Every reducing part in mode "loop" with chunks shorter than its reduction."""
    return _configured(graph, op, loop_chunk=4)


NORMS = [(s, n) for s, n in CASES if _setup(s)[1][n].cls == "normalization"]


@pytest.mark.parametrize("spec,name", NORMS)
def test_loop_over_chunks_fp32(spec, name):
    graph, ops = _setup(spec)
    source = _check(spec, name, _loop(graph, ops[name])).source
    assert "for start in range(0, n_cols, BLOCK_COL)" in source


BF16 = [("bert", "stack(q,k,v)"), ("bert", "d_b1"), ("bert", "d_ln1_gamma"), ("bert", "d_k_q"),
        ("bert", "stack(d_bv,d_bk,d_bq)"), ("gpt2", "d_bfc"), ("gpt2", "d_expr_plus_bproj_slice"), ("gpt2", "d_x")]


@pytest.mark.parametrize("spec,name", BF16)
def test_bf16(spec, name):
    graph, ops = _setup(spec, BF16_DIMS[spec])
    _check(spec, name, _permuted(graph, ops[name]), torch.bfloat16, dims="bf16")


def test_stored_dropout_mask_in_a_part():
    """knob dropout="load" in an operator of several parts: the mask is read, not regenerated.  Such
    an operator: BERT's d_b1 as derived before ``relu_masks_from_outputs`` (its dropout dX reads the mask),
    joined with d_b2 (``tests/bias_join.py``)."""
    _, forward = forward_graph("configs/bert.py", SMALL["bert"])
    fused = fuse(build_training_graph(forward, relu_masks=False))
    graph = fused.graph
    op = next(op for op in joined_bias_gradients(graph, fused.operators) if op.name == "d_b1")
    assert len(parts(op)) == 2 and "drop_act" in op.inputs
    rng = np.random.default_rng(0)
    env = execute(graph, {n: rng.standard_normal([graph.size(l) for l in t.letters]) + 0.1 for n, t in graph.tensors.items()
                          if t.role in ("input", "constant", "grad_output")}, seed=SEED)
    base = default_configuration(graph, op)
    config = Configuration(base.layouts, {**base.knobs, "dropout": "load"})
    compiled = _check_operator(graph, op, env, config)
    assert "dropout_keep(" not in compiled.source.split("def d_b1_part1")[1] and "drop_act_ptr" in compiled.source


# --- mode "split": a reduction along the tile's rows shared by several programs -------------------

SPLIT = [(s, n) for s, n in CASES if any(terminal_reductions(p) for p in parts(_setup(s)[1][n]))]


def _split(graph, op, slices: int, rows: int = 2) -> Configuration:
    """Every part with terminal reductions vectorised along an independent letter in mode "split"
    (``slices`` slices of chunks of ``rows`` rows); the other parts at their defaults."""
    chosen = []
    for part in parts(op):
        config = default_configuration(graph, part)
        if terminal_reductions(part):
            reduced = operator_letters(graph, part).reduced
            config = next(c for c in configurations(graph, part) if c.knobs["vector"] not in reduced)
            config = Configuration(config.layouts, {**config.knobs, "mode": "split", "split": slices, "block_row": rows})
        chosen.append(config)
    return chosen[0] if len(chosen) == 1 else combine_parts(chosen, 2, "regenerate")


def test_split_operators():
    """The operators with terminal reductions are those computing bias and layernorm-parameter gradients."""
    assert SPLIT == [("bert", "d_ln2_gamma"), ("bert", "d_b2"), ("bert", "d_b1"), ("bert", "d_ln1_gamma"), ("bert", "d_bo"),
                     ("bert", "stack(d_bv,d_bk,d_bq)"), ("gpt2", "d_bout"), ("gpt2", "d_bfc"), ("gpt2", "d_ln2_gain"),
                     ("gpt2", "d_bproj"), ("gpt2", "stack(d_bv,d_bk,d_bq)"), ("gpt2", "d_ln1_gain")]


@pytest.mark.parametrize("spec,name", SPLIT)
@pytest.mark.parametrize("slices", [3, 8])
def test_split_rows_fp32(spec, name, slices):
    """Slices of 2-row chunks (3: the last slice short; 8: slices past the rows, empty): one pass
    over the data, element-wise outputs stored in it; a second launch on the same scratch (the
    arrival counters back at zero) gives the same result."""
    graph, ops = _setup(spec)
    config = _split(graph, ops[name], slices)
    compiled = _check(spec, name, config)
    for source in compiled.source.split("@triton.jit")[1:]:  # each part
        if "row_slice = " in source:
            assert source.count("for start in range(") == 1
    _check(spec, name, config)


@pytest.mark.parametrize("spec,name", [("bert", "d_b1"), ("bert", "d_ln1_gamma"), ("gpt2", "d_bout")])
def test_split_rows_bf16(spec, name):
    graph, ops = _setup(spec, BF16_DIMS[spec])
    _check(spec, name, _split(graph, ops[name], 4), torch.bfloat16, dims="bf16")


def test_split_only_for_terminal_reductions():
    """A layernorm's statistics feed its outputs: no "split" in its space, and a split knob is refused."""
    graph, ops = _setup("bert", {k: v * 64 + 1 for k, v in SMALL["bert"].items()})
    assert not any(c.knobs.get("mode") == "split" for c in configurations(graph, ops["d_ffn"]))
    assert any(c.knobs.get("mode") == "split" for c in configurations(graph, ops["d_bo"]))
    config = default_configuration(graph, ops["d_ffn"])
    with pytest.raises(ValueError, match="mode 'split'"):
        compile_operator(graph, ops["d_ffn"], Configuration(config.layouts, {**config.knobs, "mode": "split", "split": 2}))


# --- dropout: one Philox call per sixteen columns, or one per element ------------------------------

DROPOUT = [(s, n) for s, n in CASES if any(_setup(s)[0].tensors[t].role == "dropout" for t in _setup(s)[1][n].inputs)]
# At GROUPED dims in the default layouts: the operators whose tile columns run along their mask's
# last logical letters (k, t, j, d) draw one call per sixteen
# columns when a block holds whole groups of 64 columns; x1, y, d_ffn, d_attn (BERT, vector i of an
# ibj mask: rows b, j) and GPT-2's d_bout (rows d of a bsd mask), reduced along columns in blocks of 16
# (or 2, 4, 8) rows, take rows 64 G + 2 t + 8 i + e of one call and one call per column for them;
# blocks of one row draw one call per element.
GROUPED_OPS = {("bert", "alpha"), ("bert", "hidden"), ("bert", "d_k_q"), ("gpt2", "attention"),
             ("gpt2", "h2"), ("gpt2", "d_expr_plus_bproj_slice"), ("gpt2", "d_q_k")}  # GPT-2 y: tiles of 32 columns
ROW_CALL_OPS = {("bert", "x1"), ("bert", "y"), ("bert", "d_ffn"), ("bert", "d_attn"), ("gpt2", "d_bout")}


@pytest.mark.parametrize("spec,name", DROPOUT)
@pytest.mark.parametrize("chunk", [None, 16])
def test_dropout_grouped(spec, name, chunk):
    """Masks regenerated at sequence length 64 (GPT-2: D = 64 too), in whole rows (default knobs,
    16 rows per block where the reduction runs along columns) or in chunks of 16 columns (loop mode,
    16 rows; element-wise tiles of 16 columns; blocks of 16 rows take one call's rows in both modes): one Philox call per sixteen columns where whole rows
    run along the mask's last letters, else one per element; either way the executor's mask (same
    seed and offsets)."""
    graph, ops = _setup(spec, GROUPED[spec])
    config = _configured(graph, ops[name], loop_chunk=chunk, block_col=chunk, loop_rows=16, row_rows=16)
    source = _check(spec, name, config, dims="grouped").source
    grouped = (spec, name) in GROUPED_OPS and chunk is None
    row_calls = (spec, name) in ROW_CALL_OPS  # 16 rows per block in either mode: the rows of one call
    assert ("one Philox call per sixteen columns" in source) == grouped
    assert ("one Philox call per column for the block's rows" in source) == row_calls
    assert "one Philox call per sixteen rows" not in source
    assert grouped or row_calls or "dropout_keep(" in source


@pytest.mark.parametrize("rows", [2, 4, 8])
@pytest.mark.parametrize("spec,name", sorted(ROW_CALL_OPS))
@pytest.mark.parametrize("chunk", [None, 16])
def test_dropout_row_calls_in_fewer_rows(spec, name, rows, chunk):
    """Blocks of 2, 4 or 8 rows of a reduction along columns whose mask runs along the rows take
    that many bytes of one Philox call per column (rows 64 G + 2 t + 8 i + e for consecutive i):
    the executor's mask, in whole rows and in loop mode."""
    graph, ops = _setup(spec, GROUPED[spec])
    config = _configured(graph, ops[name], loop_chunk=chunk, loop_rows=rows, row_rows=rows)
    source = _check(spec, name, config, dims="grouped").source
    assert "one Philox call per column for the block's rows" in source and "dropout_keep(" not in source


@pytest.mark.parametrize("spec,name", [("bert", "alpha"), ("bert", "hidden"), ("bert", "d_k_q"), ("bert", "x1")])
def test_dropout_per_element_in_blocks_of_four(spec, name):
    """Blocks of 4 columns (alpha, hidden, d_k_q) split the groups of Philox calls: one call per
    element; so does a reduction along columns (x1) in chunks of 4 columns and one row per block."""
    graph, ops = _setup(spec, GROUPED[spec])
    config = _configured(graph, ops[name], loop_chunk=4, block_col=4, loop_rows=1 if name == "x1" else 4)
    source = _check(spec, name, config, dims="grouped").source
    assert "one Philox call per sixteen" not in source and "dropout_keep(" in source


@pytest.mark.parametrize("spec,name", [("bert", "alpha"), ("bert", "x1"), ("gpt2", "h2"), ("gpt2", "d_bout")])
def test_dropout_per_element_at_extents_of_four(spec, name):
    """Sequence length 12 (GPT-2: D = 12 too), a multiple of 4 but not of 8: rows of the masks'
    trailing letters do not start on a Philox call, so blocks of 8 columns (rows) still draw one
    call per element."""
    graph, ops = _setup(spec, QUARTETS[spec])
    config = _configured(graph, ops[name], loop_chunk=8, block_col=8, loop_rows=8, row_rows=16)
    source = _check(spec, name, config, dims="quartets").source
    assert "one Philox call per sixteen" not in source and "dropout_keep(" in source


@pytest.mark.parametrize("mode", ["row", "loop"])
def test_dropout_grouped_with_the_vector_letter_not_reduced(mode):
    """GPT-2 d_bout vectorised along d (its bsd mask's last letter, not reduced): tile columns are
    d in one block of 64 (D = 64), the reduction over b, s runs along the tile rows (in one block,
    or in chunks of 16 rows)."""
    graph, ops = _setup("gpt2", GROUPED["gpt2"])
    op = ops["d_bout"]
    knobs = next(k for k in knob_choices(graph, operator_letters(graph, op), "d", "bsd", exhaustive=True)
                 if k["mode"] == mode)
    config = Configuration({t: graph.tensors[t].letters for t in (*op.inputs, *op.outputs)}, {**knobs, "block_col": 64})
    source = _check("gpt2", "d_bout", config, dims="grouped").source
    assert "one Philox call per sixteen columns" in source and "dropout_keep(" not in source


# --- parts and their configuration spaces -------------------------------------------------------

def test_parts_of_stacked_and_joined_operators():
    graph, bert = _setup("bert")
    assert [p.outputs for p in parts(bert["stack(q,k,v)"])] == [("q",), ("k",), ("v",)]
    assert [p.outputs for p in parts(bert["stack(d_bv,d_bk,d_bq)"])] == [("d_bv",), ("d_bk",), ("d_bq",)]
    assert len(parts(bert["d_b1"])) == 1 and len(parts(bert["d_b2"])) == 1
    joined = next(op for op in joined_bias_gradients(graph, list(bert.values())) if op.name == "d_b1")
    assert [p.outputs for p in parts(joined)] == [("d_b2",), ("d_pre_act", "d_b1")]
    assert len(parts(bert["x1"])) == 1 and parts(bert["x1"])[0].primitives == bert["x1"].primitives
    source = compile_operator(graph, joined, default_configuration(graph, joined)).source
    assert source.count("@triton.jit") == 4  # _tanh, two parts, the dispatching kernel
    assert "if pid < end_0:" in source and "d_b1_part1(pid - end_0," in source


@pytest.mark.parametrize("spec,name", CASES)
def test_configuration_space(spec, name):
    """Rule 5: a multi-part space is the all-default configuration, then the sum of its parts'
    pruned spaces (the others at default), each part following rules 1, 3 and 4; every
    configuration distinct; ``fixed`` layouts respected."""
    graph, ops = _setup(spec, {k: v * 64 + 1 for k, v in SMALL[spec].items()})
    op = ops[name]
    configs = configurations(graph, op)
    assert configs and len({c.key() for c in configs}) == len(configs)
    split = parts(op)
    externals = set(op.inputs) | set(op.outputs)
    for config in configs:
        assert set(config.layouts) == externals
    if len(split) > 1:
        spaces = [configurations(graph, part) for part in split]
        assert configs[0].key() == default_configuration(graph, op).key()
        assert max(map(len, spaces)) <= len(configs) <= sum(map(len, spaces)) + 1
        for k, space in enumerate(spaces):  # each part ranges over its whole pruned space
            strip = lambda knobs: {n: v for n, v in knobs.items() if n != "dropout"}  # noqa: E731
            own = {str((strip({**c.knobs["parts"][k], "num_warps": c.knobs["num_warps"]}),
                        {t: c.layouts[t] for t in space[0].layouts})) for c in configs}
            assert own >= {str((strip(c.knobs), c.layouts)) for c in space}
        for config in configs:
            assert len(config.knobs["parts"]) == len(split)
            for part, own in zip(split, config.knobs["parts"]):
                assert own["vector"] in operator_letters(graph, part).letters
                assert own["block_row"] * own["block_col"] <= 16384
    tensor = op.outputs[0]
    layout = configs[-1].layouts[tensor]
    fixed = configurations(graph, op, fixed={tensor: layout})
    assert fixed and all(c.layouts[tensor] == layout for c in fixed)


def test_snapshot_matches_front_end():
    pytest.importorskip("dace")
    import json
    assert snapshot.live_training() == json.loads(snapshot.TRAINING_PATH.read_text())


# --- GPU at BERT-large / GPT-2 dims ---------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("spec,name", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_full_size_gpu(spec, name, dtype):
    """Spec dims; random inputs (no whole-graph float64 run on the device), reference: the
    operator's primitives in float64 on the GPU, masks regenerated with the same (seed, offset)."""
    graph, ops = GRAPHS[spec]
    _check_full_size(graph, {o.name: o for o in ops}[name], dtype)


def _check_full_size(graph, op, dtype, knobs: dict | None = None):
    """``test_full_size_gpu`` on one operator of ``graph`` (at its spec dims), default and permuted
    layouts, with ``knobs`` set in both."""
    name, offsets = op.name, dropout_offsets(graph)
    gen = torch.Generator().manual_seed(0)
    values, seeds = {}, {}
    for t in op.inputs:
        info = graph.tensors[t]
        shape = [graph.size(l) for l in info.letters]
        if info.role == "dropout":
            seeds[t] = (SEED, offsets[t])
            from datamove.dataflow.dropout_mask import dropout_scale_mask
            values[t] = torch.from_numpy(dropout_scale_mask(SEED, offsets[t], tuple(shape), info.p)).cuda()
        else:
            values[t] = (torch.randn(shape, generator=gen, dtype=torch.float64) + 0.1).cuda()
    reference = evaluate(graph, op, values, torch.float64)
    baseline = evaluate(graph, op, {t: v.to(dtype) for t, v in values.items()}, dtype)
    for config in (default_configuration(graph, op), _permuted(graph, op)):
        config = Configuration(config.layouts, {**config.knobs, **(knobs or {})})
        compiled = compile_operator(graph, op, config)
        tensors = {}
        for t in compiled.loads:
            tensors[t] = allocate(graph, t, config.layouts[t], dtype, "cuda")
            tensors[t].copy_(values[t])
        out = compiled.run(tensors, seeds)
        for t in op.outputs:
            assert_closer(out[t], baseline[t], reference[t], factor=1.5 if dtype == torch.bfloat16 else 1.0,
                          margin=BF16_MARGIN if dtype == torch.bfloat16 else 1e-5, what=f"{name}:{t} {config.key()}")


def test_grouped_refuse_a_misaligned_offset():
    """A counter offset that is not a multiple of 64 would split the groups of calls: a clear error, not a wrong mask."""
    graph, ops = _setup("bert", GROUPED["bert"])
    config = _configured(graph, ops["alpha"])
    compiled = compile_operator(graph, ops["alpha"], config)
    inputs = {t: torch.randn(*(graph.dim_values[graph.letter_dims[l]] for l in graph.tensors[t].letters))
              for t in ops["alpha"].inputs if graph.tensors[t].role != "dropout"}
    with pytest.raises(ValueError, match="not a multiple of 64"):
        compiled.run(inputs, {"drop_attn": (7, 1004)})


# --- a layernorm backward joined with its column sums (``layouts.space.column_sum_joins``) ----------

def _joins(spec: str, dims: str = "small") -> dict:
    graph, _ = _setup(spec, DIMS[dims][spec])
    return graph, {op.name: op for op in column_sum_joins(graph, GRAPHS[spec][1])}


JOINS = [(spec, name) for spec in ("bert", "gpt2") for name in _joins(spec)[1]]


def test_joins_found():
    """Each layernorm backward with the parameter gradients that read its tensors (BERT: and the
    bias gradients of what it writes); every join has its column sums over the rows."""
    assert JOINS == [("bert", "d_ln2_gamma+d_ffn+d_b2"), ("bert", "d_ln1_gamma+d_attn+d_bo"),
                     ("gpt2", "d_ln2_gain+d_expr_plus_bproj_slice+d_bproj"), ("gpt2", "d_ln1_gain+d_x")]
    graph, joins = _joins("bert")
    letters = operator_letters(graph, joins["d_ln1_gamma+d_attn+d_bo"])
    assert (letters.reduced, sorted(letters.summed)) == ("i", ["b", "j"])
    assert "d_x1" not in joins["d_ln1_gamma+d_attn+d_bo"].outputs  # made and read inside


def _joined(graph, op, programs: int, block_row: int, order_first: bool = True, sums_kept: str = "row") -> Configuration:
    """The first (or last) configuration of ``op``'s space, with ``programs``, ``block_row`` and
    ``sums_kept`` set."""
    configs = configurations(graph, op)
    assert configs and all(c.knobs["mode"] == "row" and c.knobs["programs"] in SUM_PROGRAMS for c in configs)
    assert {c.knobs["sums_kept"] for c in configs} == set(SUMS_KEPT)
    config = configs[0] if order_first else configs[-1]
    return Configuration(config.layouts, {**config.knobs, "programs": programs, "block_row": block_row,
                                          "sums_kept": sums_kept})


def _check_join(spec, name, config, dtype=torch.float32, dims="small"):
    graph, joins = _joins(spec, dims)
    return _check_operator(graph, joins[name], _reference(spec, dims), config, dtype)


@pytest.mark.parametrize("spec,name", JOINS)
@pytest.mark.parametrize("programs,block_row,sums_kept", [(1, 1, "row"), (3, 2, "row"), (128, 4, "row"), (3, 2, "tile"),
                                                          (128, 4, "tile")])
def test_joined_fp32(spec, name, programs, block_row, sums_kept):
    """One program for all rows, three visiting every third block (the last rows ragged), more
    programs than blocks; the sums kept in a row or in a tile of registers; in spec order and in
    the other order of the rows' letters; a second launch on the same scratch (the column sums and
    the counter back at zero) gives the same."""
    graph, joins = _joins(spec)
    for first in (True, False):
        config = _joined(graph, joins[name], programs, block_row, first, sums_kept)
        compiled = _check_join(spec, name, config)
        assert "_sums_kernel(" in compiled.source
        assert ("for rb in range(pid," in compiled.source) != ("for rc in range(pid," in compiled.source)
        assert ("zeros([BLOCK_ROW, BLOCK_COL]" in compiled.source) == (sums_kept == "tile")
        _check_join(spec, name, config)


@pytest.mark.parametrize("spec,name", JOINS)
@pytest.mark.parametrize("sums_kept", SUMS_KEPT)
def test_joined_bf16(spec, name, sums_kept):
    graph, joins = _joins(spec, "bf16")
    _check_join(spec, name, _joined(graph, joins[name], 5, 2, sums_kept=sums_kept), torch.bfloat16, dims="bf16")


@pytest.mark.parametrize("spec,name,block_row", [(*s, rows) for s in JOINS if any(
    _setup(s[0])[0].tensors[t].role == "dropout" for t in _joins(*s[:1])[1][s[1]].inputs) for rows in (4, 16)
    if s[0] == "bert" or rows == 16])
@pytest.mark.parametrize("sums_kept", SUMS_KEPT)
def test_joined_dropout_rows_of_one_call(spec, name, sums_kept, block_row):
    """At sequence length 64, every block a program visits draws its mask from whole Philox calls:
    BERT (an ibj mask, rows b, j): the program loops over calls, drawing each column's call once
    and taking its sixteen bytes in 16 / ``block_row`` blocks of rows (4: four blocks a call, three
    programs); GPT-2 (a bsd mask along the columns d): sixteen columns per call; never one call per
    element."""
    graph, joins = _joins(spec, "grouped")
    compiled = _check_join(spec, name, _joined(graph, joins[name], 3, block_row, sums_kept=sums_kept), dims="grouped")
    assert "dropout_keep(" not in compiled.source
    if spec == "gpt2":
        assert "one Philox call per sixteen columns" in compiled.source
    else:
        loop = compiled.source[compiled.source.index("for rc in range(pid,"):]
        drawn, blocks = loop.index("= keep_bits("), loop.index("for rq in range(16 // BLOCK_ROW)")
        assert drawn < blocks and loop.count("keep_bits(") == 1 and "unpack_rows(bits_" in loop[blocks:]


def test_joined_needs_row_mode():
    graph, joins = _joins("bert")
    op = joins["d_ln2_gamma+d_ffn+d_b2"]
    config = default_configuration(graph, op)
    with pytest.raises(ValueError, match="column sums over"):
        compile_operator(graph, op, Configuration(config.layouts, {**config.knobs, "mode": "loop", "block_col": 4}))


@pytest.mark.parametrize("sums_kept", SUMS_KEPT)
def test_joined_sums_of_more_programs_than_one_load(sums_kept):
    """300 programs of one row each (B=3 L=100): the sums kernel adds them in two loads of
    ``SUM_ROWS`` programs' sums, the second ragged."""
    graph, joins = _joins("bert", "many_rows")
    assert 300 > SUM_ROWS
    _check_join("bert", "d_ln1_gamma+d_attn+d_bo",
                _joined(graph, joins["d_ln1_gamma+d_attn+d_bo"], 300, 1, sums_kept=sums_kept), dims="many_rows")


@pytest.mark.gpu
@pytest.mark.parametrize("spec,name", JOINS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("sums_kept", SUMS_KEPT)
def test_joined_full_size_gpu(spec, name, dtype, sums_kept):
    graph, ops = GRAPHS[spec]
    _check_full_size(graph, {op.name: op for op in column_sum_joins(graph, ops)}[name], dtype, {"sums_kept": sums_kept})
