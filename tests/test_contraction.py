"""Contraction variants: einsum -> GEMM mapping, the cuBLAS path and the Triton template with epilogues.

CPU: small odd sizes, Triton through the interpreter, float64 references (float32 runs compared
tightly, bf16 runs by ``harness.accuracy``).  GPU (``-m gpu``): BERT-large sizes, bf16.
"""
import functools

import pytest
import torch

from datamove.dataflow.dropout_mask import dropout_scale, keep_mask
from datamove.harness.accuracy import assert_closer
from datamove.kernels.contraction import (Epilogue, GemmPlan, NotAGemm, blas_plans, contract, dropout_digits, empty_in_layout, enumerate_variants,
                                 layout_of, map_layouts, parse, run_cublas, run_triton, stacked_projection, stacked_spec)
from datamove.kernels.gemm import GemmConfig, GemmShape, _epilogue_split, _grouped, tma_compatible, valid_configs

SMALL = dict(p=5, h=3, i=37, b=2, j=29, k=23, w=5, u=41, s=3)
# Ragged against the interpreter's tiles, yet every stride a multiple of 16 bytes (TMA descriptors).
TMA_SIZES = dict(p=8, h=3, i=40, b=2, j=24, k=24, w=8, u=24, s=3)
# B=8, L=512, N=1024, H=16, P=64, U=4096
BERT_LARGE = dict(p=64, w=64, h=16, i=1024, b=8, j=512, k=512, u=4096, s=3)

# Forward and backward contractions of a BERT encoder layer (paper notation).
EINSUMS = [
    "phi,ibj->phbj",  # Q projection
    "phbk,phbj->hbjk",  # QK^T (beta)
    "whbk,hbjk->whbj",  # gamma = V x probabilities
    "whi,whbj->ibj",  # output projection
    "ui,ibj->ubj",  # linear1
    "phbj,ibj->phi",  # dW of the Q projection
    "phi,phbj->ibj",  # dX of the Q projection
    "hbjk,phbj->phbk",  # d(keys) of QK^T
    "sphi,ibj->sphbj",  # stacked QKV
    "sphi,sphbj->ibj",  # stacked QKV dX
    "sphbj,ibj->sphi",  # stacked QKV dW
]


def _device():
    return "cuda" if torch.cuda.is_available() else "cpu"


def _random(letters, layout, sizes, dtype=torch.float32, device=None, generator=None):
    t = empty_in_layout(letters, layout, sizes, torch.float64, "cpu")
    t.copy_(torch.randn(t.shape, dtype=torch.float64, generator=generator))
    return empty_in_layout(letters, layout, sizes, dtype, device or _device()).copy_(t)


def _poisoned(letters, layout, sizes, dtype, device=None):
    return empty_in_layout(letters, layout, sizes, dtype, device or _device()).fill_(float("nan"))


@functools.lru_cache(maxsize=None)
def _variants(spec, sizes_items):
    return enumerate_variants(spec, dict(sizes_items))


def _picked(spec, sizes, count, blas_only=False):
    """A deterministic spread of mappable plans: spec-order layouts if they map, one with two batch
    dims and one without a unit-stride matrix dim where such exist, then evenly spaced others."""
    plans = _variants(spec, tuple(sorted(sizes.items()))).plans
    if blas_only:
        plans = [p for p in plans if p.blas]
    c = parse(spec)
    chosen = [p for p in plans if p.layouts == (c.a, c.b, c.out)]
    chosen += [p for p in plans if p.batch_dims == 2][:1] + [p for p in plans if not p.blas][:1]
    chosen += plans[:: max(1, len(plans) // count)]
    unique = list(dict.fromkeys(chosen))
    return unique[:count]


def _operands(plan, sizes, dtype, seed=0, device=None):
    g = torch.Generator().manual_seed(seed)
    c = plan.contraction
    a = _random(c.a, plan.layouts[0], sizes, dtype, device, g)
    b = _random(c.b, plan.layouts[1], sizes, dtype, device, g)
    return a, b


def _rel(x, ref):
    return float((x.double().cpu() - ref.double().cpu()).norm() / ref.double().cpu().norm())


# ---------------------------------------------------------------------------------------------
# Mapping


def test_groups_of_bert_einsums():
    c = parse("phi,ibj->phbj")
    assert (c.batch, c.m, c.n, c.k) == ((), ("p", "h"), ("b", "j"), ("i",))
    c = parse("phbk,phbj->hbjk")
    assert (c.batch, c.m, c.n, c.k) == (("h", "b"), ("k",), ("j",), ("p",))
    c = parse("sphi,sphbj->ibj")
    assert (c.batch, c.m, c.n, c.k) == ((), ("i",), ("b", "j"), ("s", "p", "h"))
    with pytest.raises(ValueError, match="one operand only"):
        parse("phi,ibj->phb")


@pytest.mark.parametrize("spec", ["phi,ibj->phbj", "phbk,phbj->hbjk", "hbjk,phbk->phbj", "bji,ui->bju", "bji,bju->ui",
                                  "phbk,hbjk->phbj"])
def test_blas_plans_are_the_enumerations_without_trying_every_combination(spec):
    assert blas_plans(spec, SMALL) == enumerate_variants(spec, SMALL).blas_plans


def test_variant_counts_and_reasons():
    # A "phi": (p,h) adjacent in 4 of 6 orders; B "ibj": (b,j) adjacent in 4 of 6; the output then
    # has the M and N runs in the orders A and B fix, M first or N first: 4 * 4 * 2 = 32 of 864.
    variants = enumerate_variants("phi,ibj->phbj", SMALL)
    assert (len(variants.plans), len(variants.unmappable), variants.total) == (32, 832, 864)
    assert all(p.blas and p.batch_dims == 0 for p in variants.plans)
    plan = map_layouts("phi,ibj->phbj", ("phi", "ibj", "phbj"), SMALL)
    assert isinstance(plan, GemmPlan)
    assert (plan.batch, plan.m, plan.n, plan.k) == ((1, 1), 15, 58, 37)
    assert plan.a_strides[2:] == (37, 1) and plan.b_strides[2:] == (58, 1) and plan.c_strides[2:] == (58, 1)
    assert (plan.a_transposed, plan.b_transposed, plan.c_transposed) == (False, False, False)
    not_adjacent = map_layouts("phi,ibj->phbj", ("pih", "ibj", "phbj"), SMALL)
    assert isinstance(not_adjacent, NotAGemm)
    assert not_adjacent.reason == "M letters 'ph' not adjacent in A layout 'pih'"
    wrong_order = map_layouts("phi,ibj->phbj", ("phi", "ibj", "hpbj"), SMALL)
    assert wrong_order.reason == "M letters 'ph' in order 'hp' where another operand has 'ph' in output layout 'hpbj'"
    # Batch letters h, b: any orders give at most two runs, so every combination maps; cuBLAS needs
    # a unit-stride matrix dim, i.e. a non-batch letter innermost in every operand.
    qk = enumerate_variants("phbk,phbj->hbjk", SMALL)
    assert len(qk.unmappable) == 0 and len(qk.plans) == 24 ** 3
    assert len(qk.blas_plans) == 12 ** 3
    two = map_layouts("phbk,phbj->hbjk", ("hpbk", "phbj", "hbjk"), SMALL)
    assert two.batch_letters == (("h",), ("b",)) and two.batch == (3, 2)
    one = map_layouts("phbk,phbj->hbjk", ("hbpk", "hbpj", "hbjk"), SMALL)
    assert one.batch_letters == (("h", "b"), ()) and one.batch == (6, 1) and one.a_transposed is True
    sizes = dict(x=3, y=5, z=7, m=9, q=11, n=13)
    three_runs = map_layouts("xyzmq,xyzqn->xyzmn", ("xmyqz", "xyzqn", "xyzmn"), sizes)
    assert isinstance(three_runs, NotAGemm) and "batch letters 'xyz'" in three_runs.reason
    two_runs = map_layouts("xyzmq,xyzqn->xyzmn", ("xymqz", "xyqnz", "xymnz"), sizes)
    assert two_runs.batch_letters == (("x", "y"), ("z",)) and not two_runs.blas


@pytest.mark.parametrize("spec", EINSUMS)
def test_every_mappable_plan_computes_the_einsum(spec):
    """Each plan's sizes and strides, applied to the operands' storage, give the einsum (float64).

    All plans where there are up to 800, else 800 evenly spread ones (enumeration order)."""
    plans = _variants(spec, tuple(sorted(SMALL.items()))).plans
    plans = plans[:: max(1, len(plans) // 800)]
    assert plans
    c = parse(spec)
    a_logical = torch.randn([SMALL[x] for x in c.a], dtype=torch.float64)
    b_logical = torch.randn([SMALL[x] for x in c.b], dtype=torch.float64)
    ref = torch.einsum(spec, a_logical, b_logical)
    a_in, b_in = {}, {}
    for plan in plans:
        la, lb, lo = plan.layouts
        a = a_in.setdefault(la, empty_in_layout(c.a, la, SMALL, torch.float64).copy_(a_logical))
        b = b_in.setdefault(lb, empty_in_layout(c.b, lb, SMALL, torch.float64).copy_(b_logical))
        out = _poisoned(c.out, lo, SMALL, torch.float64, "cpu")
        (b0, b1), m, n, k = plan.batch, plan.m, plan.n, plan.k
        product = a.as_strided((b0, b1, m, k), plan.a_strides) @ b.as_strided((b0, b1, k, n), plan.b_strides)
        out.as_strided((b0, b1, m, n), plan.c_strides).copy_(product)
        assert torch.allclose(out, ref, rtol=1e-12, atol=1e-12), plan.describe()


def test_layout_of_reads_strides():
    t = empty_in_layout("ibj", "bji", SMALL)
    assert t.shape == (37, 2, 29) and layout_of(t, "ibj") == "bji"
    with pytest.raises(ValueError, match="not dense"):
        layout_of(torch.empty(37, 2, 58)[:, :, ::2], "ibj")


# ---------------------------------------------------------------------------------------------
# cuBLAS path


@pytest.mark.parametrize("spec", EINSUMS)
def test_cublas_path(spec):
    for plan in _picked(spec, SMALL, 4, blas_only=True):
        a, b = _operands(plan, SMALL, torch.float64)
        out = _poisoned(plan.contraction.out, plan.layouts[2], SMALL, torch.float64)
        run_cublas(plan, a, b, out, alpha=0.7)
        ref = 0.7 * torch.einsum(spec, a, b)
        assert torch.allclose(out, ref, rtol=1e-10, atol=1e-10), plan.describe()
        a16, b16 = a.bfloat16(), b.bfloat16()
        out16 = contract(spec, a16, b16, out_layout=plan.layouts[2])
        assert layout_of(out16, plan.contraction.out) == plan.layouts[2]
        assert_closer(out16, torch.einsum(spec, a16, b16), torch.einsum(spec, a16.double(), b16.double()), what=plan.describe())


def test_cublas_rejects_batch_innermost_and_unmappable():
    plan = map_layouts("phbk,phbj->hbjk", ("pkhb", "phbj", "hbjk"), SMALL)
    assert plan.a_transposed is None and not plan.blas
    a, b = _operands(plan, SMALL, torch.float32)
    with pytest.raises(ValueError, match="unit-stride"):
        run_cublas(plan, a, b, empty_in_layout("hbjk", "hbjk", SMALL, device=_device()))
    a = _random("phi", "pih", SMALL)
    b = _random("ibj", "ibj", SMALL)
    for backend in ("cublas", "triton"):
        with pytest.raises(ValueError, match="M letters 'ph' not adjacent in A layout 'pih'"):
            contract("phi,ibj->phbj", a, b, backend=backend)


# ---------------------------------------------------------------------------------------------
# Triton template


def _configs(tma, dtype=torch.float32):
    return [c for c in valid_configs(dtype) if c.tma == tma]


def _tma_ok(plan, a, b):
    return tma_compatible(a, b, GemmShape(*plan.batch, plan.m, plan.n, plan.k), plan.a_strides, plan.b_strides)


@pytest.mark.parametrize("spec", EINSUMS)
def test_triton_path(spec):
    configs = _configs(tma=False)
    for n, plan in enumerate(_picked(spec, SMALL, 3)):
        a, b = _operands(plan, SMALL, torch.float32, seed=n)
        out = _poisoned(plan.contraction.out, plan.layouts[2], SMALL, torch.float32)
        run_triton(plan, a, b, out, config=configs[n % len(configs)])
        ref = torch.einsum(spec, a.double(), b.double())
        assert _rel(out, ref) < 1e-6, plan.describe()
    a16, b16 = a.bfloat16(), b.bfloat16()
    out16 = contract(spec, a16, b16, out_layout=plan.layouts[2], backend="triton")
    assert_closer(out16, torch.einsum(spec, a16, b16), torch.einsum(spec, a16.double(), b16.double()), what=plan.describe())


@pytest.mark.parametrize("spec", ["phi,ibj->phbj", "phbk,phbj->hbjk", "whbj,ibj->whi", "sphi,sphbj->ibj"])
def test_triton_tma_path(spec):
    """Configs with tma=True read A and B through tensor descriptors, those with store_tma=True write
    C through one too: every transposition pattern (C's unit stride along m or n)."""
    plans = [p for p in _variants(spec, tuple(sorted(TMA_SIZES.items()))).blas_plans]
    patterns = {}
    for plan in plans:
        patterns.setdefault((plan.a_transposed, plan.b_transposed, plan.batch_dims, plan.c_strides[3] == 1), plan)
    config = _configs(tma=True)[0]  # fits float32 tiles, hence bf16 ones
    cpu = _device() == "cpu"
    persistent = next(c for c in _configs(tma=True) if c.persistent and not c.store_tma) if cpu else config
    stores = [c for c in _configs(tma=True) if c.store_tma][:2 if cpu else 1]  # one tile per program; looping, in slices
    stored = 0
    for n, plan in enumerate(patterns.values()):
        dtype = (torch.float32, torch.bfloat16)[n % 2]
        a, b = _operands(plan, TMA_SIZES, dtype, seed=n)
        assert _tma_ok(plan, a, b), plan.describe()
        ref = torch.einsum(spec, a.double(), b.double())
        out = _poisoned(plan.contraction.out, plan.layouts[2], TMA_SIZES, dtype)
        c_ok = tma_compatible(a, b, GemmShape(*plan.batch, plan.m, plan.n, plan.k), plan.a_strides, plan.b_strides,
                              out, plan.c_strides)
        stored += c_ok
        for chosen in (config, persistent, *(stores if c_ok else ())):
            out = _poisoned(plan.contraction.out, plan.layouts[2], TMA_SIZES, dtype)
            run_triton(plan, a, b, out, config=chosen)
            if dtype == torch.float32:
                assert _rel(out, ref) < 1e-6, (plan.describe(), str(chosen))
            else:
                assert_closer(out, torch.einsum(spec, a, b), ref, what=f"{plan.describe()} {chosen}")
    assert len(patterns) >= 4 and stored >= 2
    odd = _picked(spec, SMALL, 1)[0]
    a, b = _operands(odd, SMALL, torch.bfloat16)
    if not _tma_ok(odd, a, b):
        with pytest.raises(ValueError, match="TMA-compatible"):
            run_triton(odd, a, b, _poisoned(odd.contraction.out, odd.layouts[2], SMALL, torch.bfloat16), config=config)


def _broadcast(bias, bias_letters, out_letters):
    """``bias`` (dims ``bias_letters``) viewed with the dims of ``out_letters``, size 1 where it lacks one."""
    held = [x for x in out_letters if x in bias_letters]
    bias = bias.permute([bias_letters.index(x) for x in held])
    return bias.reshape([bias.shape[held.index(x)] if x in held else 1 for x in out_letters])


def _epilogue_reference(spec, a, b, sizes, ep):
    """float64 reference of an epilogue, on the operands' device: (out, pre-activation, pre-dropout)."""
    c = parse(spec)
    y = ep.alpha * torch.einsum(spec, a.double(), b.double())
    if ep.bias is not None:
        y = y + _broadcast(ep.bias.double(), ep.bias_letters, c.out)
    pre_activation = y
    if ep.activation == "relu":
        y = torch.relu(y)
    elif ep.activation == "gelu":
        y = torch.nn.functional.gelu(y, approximate="tanh")
    pre_dropout = y
    if ep.dropout_p > 0:
        keep = torch.from_numpy(keep_mask(ep.seed, ep.offset, tuple(sizes[x] for x in c.out), ep.dropout_p)).to(y.device)
        y = torch.where(keep, y * dropout_scale(ep.dropout_p), 0.0)
    return y, pre_activation, pre_dropout


EPILOGUE_CASES = [
    # spec, layouts (A, B, out), bias letters, activation, dropout p, save
    ("ui,ibj->ubj", ("ui", "ibj", "ubj"), "u", "relu", 0.1, "pre_dropout"),
    ("ui,ibj->ubj", ("iu", "jbi", "jbu"), "u", "gelu", 0.3, "pre_activation"),
    ("phi,ibj->phbj", ("hpi", "ijb", "jbhp"), "ph", "none", 0.2, None),
    ("whi,whbj->ibj", ("whi", "whbj", "bji"), "i", "relu", 0.0, "pre_activation"),
    ("phbk,phbj->hbjk", ("hpbk", "phbj", "hbjk"), "", "none", 0.1, None),  # two batch dims, scale only
    ("sphi,ibj->sphbj", ("sphi", "ibj", "sphbj"), "sph", "none", 0.1, None),
]


@pytest.mark.filterwarnings("ignore:overflow encountered in exp")  # interpreter: sigmoid of large negatives
@pytest.mark.parametrize("case", EPILOGUE_CASES, ids=lambda case: f"{case[0]}:{case[1][2]}")
def test_triton_epilogue(case):
    """Each case in float32 (with the whole-tile epilogue, with 4 column slices and on a persistent
    grid of programs looping over tiles) and bf16."""
    whole = _configs(tma=False)[0]
    sliced = next(cfg for cfg in valid_configs() if cfg.epilogue_split == 4) if _device() == "cpu" else whole
    persistent = next(cfg for cfg in _configs(tma=False) if cfg.persistent) if _device() == "cpu" else whole
    _check_epilogue(case, SMALL, ((torch.float32, whole), (torch.float32, sliced), (torch.float32, persistent),
                                  (torch.bfloat16, whole)))


@pytest.mark.filterwarnings("ignore:overflow encountered in exp")
@pytest.mark.parametrize("out_layout", ["ubj", "bju"])
def test_triton_epilogue_stored_by_tma(out_layout):
    """`hidden`'s epilogue (bias, ReLU, dropout, the pre-dropout value saved) written through a TMA
    store, C's unit stride along n or m: one tile per program and, on the CPU, programs looping over
    tiles with the epilogue in two column slices."""
    sizes = {**TMA_SIZES, "j": 64}  # whole groups of 64 dropout counters along j
    stores = [cfg for cfg in _configs(tma=True) if cfg.store_tma][:2 if _device() == "cpu" else 1]
    case = ("ui,ibj->ubj", ("ui", "ibj", out_layout), "u", "relu", 0.1, "pre_dropout")
    _check_epilogue(case, sizes, [(torch.float32, cfg) for cfg in stores] + [(torch.bfloat16, stores[-1])])


def _check_epilogue(case, sizes, runs):
    """The fused epilogue of ``case`` (see EPILOGUE_CASES) at ``sizes`` under each (dtype, config) of
    ``runs``: float32 as the float64 reference, bf16 as close to it as PyTorch's bf16 eager version;
    the dropout mask exactly ``keep_mask``."""
    spec, layouts, bias_letters, activation, p, save = case
    plan = map_layouts(spec, layouts, sizes)
    assert isinstance(plan, GemmPlan)
    c = plan.contraction
    for dtype, config in runs:
        a, b = _operands(plan, sizes, dtype, seed=7)
        bias = None
        if bias_letters:  # stored in the order its letters have in the output layout
            bias = _random(bias_letters, "".join(x for x in layouts[2] if x in bias_letters), sizes, dtype)
        ep = Epilogue(alpha=0.125 if not bias_letters else 1.0, bias=bias, bias_letters=bias_letters, activation=activation,
                      dropout_p=p, seed=0xD00D + len(spec), offset=1001, save=save)
        out = _poisoned(c.out, plan.layouts[2], sizes, dtype)
        result = run_triton(plan, a, b, out, ep, config)
        ref, pre_activation, pre_dropout = _epilogue_reference(spec, a, b, sizes, ep)
        saved = None
        if save:
            out, saved = result
            assert layout_of(saved, c.out) == plan.layouts[2]
        if p > 0:
            keep = torch.from_numpy(keep_mask(ep.seed, ep.offset, tuple(out.shape), p))
            assert torch.all(out.cpu()[~keep] == 0)
            keep = keep.to(out.device)
            assert 0.5 < keep.double().mean() / (1 - p) < 1.5
        saved_ref = pre_activation if save == "pre_activation" else pre_dropout
        if dtype == torch.float32:
            assert _rel(out, ref) < 1e-6
            if save:
                assert _rel(saved, saved_ref) < 1e-6
        else:  # PyTorch's own bf16 eager version of the same epilogue is the baseline
            y = ep.alpha * torch.einsum(spec, a, b)
            if bias is not None:
                y = y + _broadcast(bias, bias_letters, c.out)
            base_pre = y
            y = {"relu": torch.relu, "gelu": lambda t: torch.nn.functional.gelu(t, approximate="tanh"),
                 "none": lambda t: t}[activation](y)
            base_saved = base_pre if save == "pre_activation" else y
            if p > 0:
                y = torch.where(keep, y * dropout_scale(p), torch.zeros_like(y))
            assert_closer(out, y, ref, what=f"{spec} bf16")
            if save:
                assert_closer(saved, base_saved, saved_ref, what=f"{spec} bf16 saved")


def test_dropout_mask_independent_of_layout():
    """The same seed gives the same logical mask whatever the output layout."""
    spec, sizes = "ui,ibj->ubj", SMALL
    masks = []
    for b_layout, out_layout in (("ibj", "ubj"), ("ijb", "jbu"), ("bji", "bju")):
        a = _random("ui", "ui", sizes, generator=torch.Generator().manual_seed(3))
        b = _random("ibj", b_layout, sizes, generator=torch.Generator().manual_seed(4))
        out = contract(spec, a, b, out_layout=out_layout, backend="triton",
                       epilogue=Epilogue(dropout_p=0.5, seed=77, offset=5))
        masks.append((out != 0).cpu())
    assert torch.equal(masks[0], masks[1]) and torch.equal(masks[0], masks[2])
    expected = torch.from_numpy(keep_mask(77, 5, (41, 2, 29), 0.5))
    assert torch.equal(masks[0], expected)


GROUPED_SIZES = {**SMALL, "j": 64, "k": 64}  # j, k whole groups of 64 counters (u, i, p still ragged against the tiles)
GROUPED_CONFIGS = (GemmConfig(64, 64, 16, 1, 1, 4), GemmConfig(64, 128, 16, 1, 1, 4, epilogue_split=2))  # whole groups
NARROW_SLICES = GemmConfig(16, 16, 16, 1, 1, 4, epilogue_split=4)  # epilogue on slices of 4 columns


def _check_dropout(spec, plan, sizes, offset, config):
    """The epilogue's dropout under ``config`` is exactly ``keep_mask``, its values the float64 reference's."""
    a, b = _operands(plan, sizes, torch.float32, seed=9)
    ep = Epilogue(alpha=0.5, dropout_p=0.3, seed=4242, offset=offset)
    out = run_triton(plan, a, b, _poisoned(plan.contraction.out, plan.layouts[2], sizes, torch.float32), ep, config)
    keep = torch.from_numpy(keep_mask(ep.seed, offset, tuple(out.shape), ep.dropout_p))
    assert torch.equal((out != 0).cpu(), keep)
    assert _rel(out, _epilogue_reference(spec, a, b, sizes, ep)[0]) < 1e-6


@pytest.mark.parametrize("spec,layouts,sizes,offset,mode", [
    ("ui,ibj->ubj", ("ui", "ibj", "ubj"), GROUPED_SIZES, 1024, "n"),  # n = (b, j), j innermost
    ("ui,ibj->ubj", ("iu", "bji", "bju"), GROUPED_SIZES, 1024, "n"),  # C stored u-contiguous
    ("phbk,phbj->hbjk", ("hpbk", "phbj", "hbjk"), GROUPED_SIZES, 1024, "m"),  # m = k, two batch dims
    ("ui,ibj->ubj", ("ui", "ijb", "ujb"), GROUPED_SIZES, 1024, "none"),  # n = (j, b): b innermost
    ("ui,ibj->ubj", ("ui", "ibj", "ubj"), GROUPED_SIZES, 1032, "none"),  # the mask does not start a group of 64
    ("ui,ibj->ubj", ("ui", "ibj", "ubj"), {**GROUPED_SIZES, "j": 72}, 1024, "none"),  # rows of 72 split groups
])
def test_dropout_grouped_and_per_element(spec, layouts, sizes, offset, mode):
    """Sixteen decisions per Philox call along C's n or m dim where it runs along the output's last
    letter over a multiple of 64, else one per element: either way exactly ``keep_mask`` (whole and
    sliced epilogue)."""
    plan = map_layouts(spec, layouts, sizes)
    assert isinstance(plan, GemmPlan)
    for config in GROUPED_CONFIGS if _device() == "cpu" else _configs(tma=False)[:1]:
        tile = (config.block_m, config.block_n // _epilogue_split(config, dropout=True))
        assert _grouped(dropout_digits(plan, sizes), offset, tile) == mode
        _check_dropout(spec, plan, sizes, offset, config)


def test_dropout_grouped_split_by_narrow_epilogue_slices():
    """Epilogue slices of 4 columns would split the groups of calls along n: one call per element."""
    plan = map_layouts("ui,ibj->ubj", ("ui", "ibj", "ubj"), GROUPED_SIZES)
    assert _grouped(dropout_digits(plan, GROUPED_SIZES), 1024, (16, 4)) == "none"
    _check_dropout("ui,ibj->ubj", plan, GROUPED_SIZES, 1024, NARROW_SLICES)


# ---------------------------------------------------------------------------------------------
# Stacked (algebraic) contractions


def test_stacked_specs():
    assert stacked_spec("phi,ibj->phbj", [0]) == "sphi,ibj->sphbj"
    assert stacked_spec("phi,phbj->ibj", [0, 1]) == "sphi,sphbj->ibj"
    assert stacked_spec("phbj,ibj->phi", [0]) == "sphbj,ibj->sphi"
    c = parse("sphi,ibj->sphbj")
    assert c.m == ("s", "p", "h") and c.n == ("b", "j") and c.k == ("i",)


@pytest.mark.parametrize("backend", ["cublas", "triton"])
def test_stacked_qkv_equals_three_einsums(backend):
    g = torch.Generator().manual_seed(11)
    w = _random("sphi", "sphi", SMALL, generator=g)
    x = _random("ibj", "bji", SMALL, generator=g)
    grad = _random("sphbj", "bjsph", SMALL, generator=g)
    q, k, v = stacked_projection("phi,ibj->phbj", w, x, out_layout="bjsph", backend=backend)
    for s, projected in enumerate((q, k, v)):
        assert _rel(projected, torch.einsum("phi,ibj->phbj", w[s].double(), x.double())) < 1e-6
    dx = contract("sphi,sphbj->ibj", w, grad, out_layout="bji", backend=backend)
    dx_ref = sum(torch.einsum("phi,phbj->ibj", w[s].double(), grad[s].double()) for s in range(3))
    assert _rel(dx, dx_ref) < 1e-6
    dw = contract("sphbj,ibj->sphi", grad, x, out_layout="sphi", backend=backend)
    dw_ref = torch.stack([torch.einsum("phbj,ibj->phi", grad[s].double(), x.double()) for s in range(3)])
    assert _rel(dw, dw_ref) < 1e-6


# ---------------------------------------------------------------------------------------------
# GPU, BERT-large, bf16


GPU_EINSUMS = EINSUMS + ["iu,ubj->ibj", "ubj,ibj->ui", "whbj,hbjk->whbk"]


@pytest.mark.gpu
@pytest.mark.parametrize("spec", GPU_EINSUMS)
def test_gpu_bert_large(spec):
    sizes = BERT_LARGE
    for n, plan in enumerate(_picked(spec, sizes, 2, blas_only=True)):
        a, b = _operands(plan, sizes, torch.bfloat16, seed=n, device="cuda")
        ref = torch.einsum(spec, a.double(), b.double())
        baseline = torch.einsum(spec, a, b)
        out = _poisoned(plan.contraction.out, plan.layouts[2], sizes, torch.bfloat16)
        run_cublas(plan, a, b, out)  # warm-up: cuBLAS handle and workspace
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        out.fill_(float("nan"))
        run_cublas(plan, a, b, out)
        torch.cuda.synchronize()
        assert torch.cuda.max_memory_allocated() == before, f"{plan.describe()}: cuBLAS path allocated (a copy)"
        assert_closer(out, baseline, ref, what=f"cuBLAS {plan.describe()}")
        configs = [c for c in valid_configs(torch.bfloat16) if str(c) in ("128x128x64 g8 s4 w8", "128x256x64 g8 s3 w8 tma")]
        for config in configs if _tma_ok(plan, a, b) else configs[:1]:
            out.fill_(float("nan"))
            run_triton(plan, a, b, out, config=config)
            assert_closer(out, baseline, ref, what=f"Triton {config} {plan.describe()}")


@pytest.mark.gpu
@pytest.mark.parametrize("config", ["128x128x64 g8 s4 w8", "128x256x64 g8 s3 w8 tma"])
def test_gpu_linear1_fused_epilogue(config):
    sizes, spec = BERT_LARGE, "ui,ibj->ubj"
    config = next(c for c in valid_configs(torch.bfloat16) if str(c) == config)
    plan = map_layouts(spec, ("ui", "ibj", "ubj"), sizes)
    a, b = _operands(plan, sizes, torch.bfloat16, seed=5, device="cuda")
    bias = _random("u", "u", sizes, torch.bfloat16, "cuda")
    ep = Epilogue(bias=bias, bias_letters="u", activation="relu", dropout_p=0.1, seed=1234, offset=0, save="pre_dropout")
    out = _poisoned("ubj", "ubj", sizes, torch.bfloat16)
    out, saved = run_triton(plan, a, b, out, ep, config)
    ref, _, pre_dropout = _epilogue_reference(spec, a, b, sizes, ep)
    keep = torch.from_numpy(keep_mask(1234, 0, tuple(out.shape), 0.1)).cuda()
    y = torch.relu(torch.einsum(spec, a, b) + bias[:, None, None])
    assert_closer(saved, y, pre_dropout, what="pre-dropout")
    assert_closer(out, torch.where(keep, y * dropout_scale(0.1), torch.zeros_like(y)), ref, what="linear1 + bias + relu + dropout")
    assert torch.all(out[~keep] == 0)
    assert abs(keep.double().mean().item() - 1 / dropout_scale(0.1)) < 1e-3  # kept: 230 / 256
