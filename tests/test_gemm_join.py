"""The GEMM template's join epilogue (``kernels.gemm_join``): a Llama SwiGLU MLP's element-wise work in
its GEMMs' epilogues.  Forward, pair mode: gate = x @ W_gate, up = x @ W_up from one stacked weight
buffer, then silu(gate) and silu(gate) * up, gate and up stored too.  Backward, single mode: dh = dy @
W_down^T, then d_up = dh * silu(gate) and d_gate = dh * up * silu'(gate), dh not stored (or stored).
Checked against float64 on fresh random inputs in odd sizes and several storage orders, on every
config (the Triton interpreter on the CPU; the ``gpu`` tests at Llama sizes on every Hopper config
that fits), within 1.25 x PyTorch's own error in the same dtype plus a small margin."""
import math

import pytest
import torch
import triton
import triton.language as tl

from datamove.kernels.gemm import GemmConfig, GemmShape, fitted, pair_fits, valid_configs
from datamove.kernels.gemm_join import JoinEpilogue, gemm_join

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SIZES = dict(a=2, b=3, m=37, n=45, k=29)  # a, b: the batch dims b0, b1
MARGIN = {torch.float32: 1e-6, torch.bfloat16: 1e-4}


@triton.jit
def swiglu_forward(gate, up):
    s = gate * tl.sigmoid(gate)
    return s, s * up


@triton.jit
def swiglu_backward(dh, up, s, gate):
    sig = tl.sigmoid(gate)
    return dh * s, dh * up * sig * (1.0 + gate * (1.0 - sig))


def stored(values: torch.Tensor, order: str, letters: str) -> torch.Tensor:
    """``values`` (dims named by ``letters``) copied into fresh storage whose dims run in ``order``
    (outermost first; a letter missing from ``order`` is broadcast, stride 0, and ``values`` must be
    constant along it), the innermost padded to a multiple of 8 elements so that every stride is a
    multiple of 16 bytes (TMA); the view has ``values``' dim order and its first element is element 0."""
    sizes = dict(zip(letters, values.shape))
    padded = [sizes[x] for x in order]
    padded[-1] = -(-padded[-1] // 8) * 8
    storage = torch.full(padded, float("nan"), dtype=values.dtype, device=values.device)
    inner = storage[..., :sizes[order[-1]]]
    kept = [x for x in letters if x in order]
    inner.copy_(values[tuple(slice(None) if x in order else 0 for x in letters)].permute([kept.index(x) for x in order]))
    view = inner.permute([order.index(x) for x in kept])
    for i, x in enumerate(letters):
        if x not in order:
            view = view.unsqueeze(i)
    return view.expand(values.shape)


def empty(letters: str, order: str, dtype: torch.dtype) -> torch.Tensor:
    return stored(torch.full([SIZES[x] for x in letters], float("nan"), dtype=dtype, device=DEVICE), order, letters)


def error(x: torch.Tensor, reference: torch.Tensor) -> float:
    """Relative error (Frobenius norms) of ``x`` against the float64 ``reference``; NaN where x has one."""
    return float((x.double() - reference).norm() / reference.norm())


def strides(t: torch.Tensor) -> tuple[int, ...]:
    return tuple(t.stride())


def randn(*shape: int, gen: torch.Generator, dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(*shape, generator=gen).to(dtype).to(DEVICE)


def _torch_forward(x, w0, w1):
    """(gate, up, silu(gate), silu(gate) * up) by PyTorch in the inputs' dtype (float64 in, float64 out)."""
    gate, up = torch.matmul(x, w0), torch.matmul(x, w1)
    s = torch.nn.functional.silu(gate)
    return gate, up, s, s * up


def _torch_backward(dy, w, up, s, gate):
    """(d_up, d_gate) by PyTorch in the inputs' dtype."""
    dh = torch.matmul(dy, w)
    sig = torch.sigmoid(gate)
    return dh * s, dh * up * sig * (1 + gate * (1 - sig))


# (x's storage order, the stacked weight's ("s": which of gate / up; missing batch letters: shared), outputs')
FORWARD_LAYOUTS = [
    ("abmk", "skn", ("abmn", "abmn", "abmn", "abmn")),
    ("kbam", "snk", ("nabm", "bamn", "mnab", "nmba")),  # A m-major, B k-major (nn.Linear's weight), C m-major
    ("mbak", "bnsak", ("anbm", "bmna", "abmn", "nbam")),  # a weight per batch, the stack dim inside; up batch-minor
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", range(len(FORWARD_LAYOUTS)))
def test_swiglu_forward_pair(layout, dtype):
    x_order, w_order, out_orders = FORWARD_LAYOUTS[layout]
    gen = torch.Generator().manual_seed(11 + layout)
    b0, b1, m, n, k = (SIZES[x] for x in "abmnk")
    batched = "a" in w_order
    x = stored(randn(b0, b1, m, k, gen=gen, dtype=dtype), x_order, "abmk")
    w_values = randn(2, b0, b1, k, n, gen=gen, dtype=dtype) if batched else \
        randn(2, 1, 1, k, n, gen=gen, dtype=dtype).expand(2, b0, b1, k, n)
    w = stored(w_values, w_order, "sabkn")
    w0, w1 = w[0], w[1]
    references = _torch_forward(x.double(), w0.double(), w1.double())
    baselines = _torch_forward(x, w0, w1)
    tolerances = [1.25 * error(t, r) + MARGIN[dtype] for t, r in zip(baselines, references)]
    for config in valid_configs(dtype):
        gate, up, s, h = (empty("abmn", order, dtype) for order in out_orders)
        join = JoinEpilogue(swiglu_forward, b1=w1, stores=(s, h), store_strides=(strides(s), strides(h)),
                            acc1=up, acc1_strides=strides(up))
        gemm_join(x, w0, gate, GemmShape(b0, b1, m, n, k), strides(x), strides(w0), strides(gate), join, config=config)
        for name, out, reference, tolerance in zip(("gate", "up", "s", "h"), (gate, up, s, h), references, tolerances):
            assert error(out, reference) <= tolerance, (name, str(config), error(out, reference), tolerance)


# (dy's order, the weight's (batch letters missing: shared), up's, s's, gate's, d_up's, d_gate's, dh's or None)
BACKWARD_LAYOUTS = [
    ("abmk", "kn", "abmn", "abmn", "abmn", "abmn", "abmn", None),
    ("kabm", "nk", "nabm", "bamn", "mnab", "nmba", "abnm", None),  # A m-major, B k-major, loads in any order
    ("bmak", "bnak", "abmn", "mabn", "abnm", "bamn", "nabm", "nbam"),  # a weight per batch; dh stored, m-major
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", range(len(BACKWARD_LAYOUTS)))
def test_swiglu_backward_single(layout, dtype):
    dy_order, w_order, up_order, s_order, g_order, du_order, dg_order, dh_order = BACKWARD_LAYOUTS[layout]
    gen = torch.Generator().manual_seed(23 + layout)
    b0, b1, m, n, k = (SIZES[x] for x in "abmnk")
    dy = stored(randn(b0, b1, m, k, gen=gen, dtype=dtype), dy_order, "abmk")
    w_values = randn(b0, b1, k, n, gen=gen, dtype=dtype) if "a" in w_order else \
        randn(1, 1, k, n, gen=gen, dtype=dtype).expand(b0, b1, k, n)
    w = stored(w_values, w_order, "abkn")
    gate_values = randn(b0, b1, m, n, gen=gen, dtype=dtype)
    up = stored(randn(b0, b1, m, n, gen=gen, dtype=dtype), up_order, "abmn")
    s = stored(torch.nn.functional.silu(gate_values.float()).to(dtype), s_order, "abmn")
    gate = stored(gate_values, g_order, "abmn")
    references = _torch_backward(dy.double(), w.double(), up.double(), s.double(), gate.double())
    baselines = _torch_backward(dy, w, up, s, gate)
    tolerances = [1.25 * error(t, r) + MARGIN[dtype] for t, r in zip(baselines, references)]
    dh_reference = torch.matmul(dy.double(), w.double())
    dh_tolerance = 1.25 * error(torch.matmul(dy, w), dh_reference) + MARGIN[dtype]
    for config in valid_configs(dtype):
        d_up, d_gate = empty("abmn", du_order, dtype), empty("abmn", dg_order, dtype)
        dh = empty("abmn", dh_order, dtype) if dh_order else None
        join = JoinEpilogue(swiglu_backward, loads=(up, s, gate), load_strides=tuple(map(strides, (up, s, gate))),
                            stores=(d_up, d_gate), store_strides=(strides(d_up), strides(d_gate)))
        returned = gemm_join(dy, w, dh, GemmShape(b0, b1, m, n, k), strides(dy), strides(w),
                        strides(dh) if dh is not None else (0, 0, 0, 0), join, config=config)
        assert returned is dh
        for name, out, reference, tolerance in zip(("d_up", "d_gate"), (d_up, d_gate), references, tolerances):
            assert error(out, reference) <= tolerance, (name, str(config), error(out, reference), tolerance)
        if dh is not None:
            assert error(dh, dh_reference) <= dh_tolerance, ("dh", str(config))


def test_alpha_scales_both_products_and_a_stride_zero_load_broadcasts():
    """acc0 and acc1 are alpha times their products; a loaded tensor with stride 0 along m is a row vector."""
    gen = torch.Generator().manual_seed(5)
    m, n, k = 19, 21, 17
    x, w0, w1, row = (randn(*s, gen=gen, dtype=torch.float32) for s in ((m, k), (k, n), (k, n), (n,)))
    s, h = torch.empty(m, n), torch.empty(m, n)
    join = JoinEpilogue(_add_row, b1=w1, loads=(row,), load_strides=((0, 0, 0, 1),), stores=(s, h),
                        store_strides=((0, 0, n, 1),) * 2)
    assert gemm_join(x, w0, None, GemmShape(1, 1, m, n, k), (0, 0, k, 1), (0, 0, n, 1), (0, 0, 0, 0), join, alpha=0.5,
                     config=valid_configs()[0]) is None
    g, u = 0.5 * (x.double() @ w0.double()), 0.5 * (x.double() @ w1.double())
    torch.testing.assert_close(s.double(), g + row.double(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(h.double(), u * row.double(), rtol=1e-6, atol=1e-6)


@triton.jit
def _add_row(gate, up, row):
    return gate + row, up * row


def test_join_refuses_other_epilogues_and_misfits():
    m, n, k = 16, 16, 16
    x, w = torch.randn(m, k), torch.randn(k, n)
    out, other = torch.empty(m, n), torch.empty(m, n)
    st, shape = (0, 0, n, 1), GemmShape(1, 1, m, n, k)
    join = JoinEpilogue(swiglu_forward, b1=w, stores=(out, other), store_strides=(st, st))
    with pytest.raises(ValueError, match="do not fit"):  # two 128 x 256 accumulators at 8 warps
        gemm_join(x, w, out, shape, (0, 0, k, 1), st, st, join, config=GemmConfig(128, 256, 64, 8, 3, 8))
    with pytest.raises(ValueError, match="one stride tuple per"):
        gemm_join(x, w, out, shape, (0, 0, k, 1), st, st, JoinEpilogue(swiglu_forward, b1=w, stores=(out,)))
    with pytest.raises(ValueError, match="at most 4"):
        gemm_join(x, w, out, shape, (0, 0, k, 1), st, st, JoinEpilogue(swiglu_backward, loads=(other,) * 5,
                                                                            load_strides=(st,) * 5))
    with pytest.raises(ValueError, match="only in pair mode"):
        gemm_join(x, w, out, shape, (0, 0, k, 1), st, st, JoinEpilogue(swiglu_backward, stores=(other,),
                  store_strides=(st,), acc1=other, acc1_strides=st))
    with pytest.raises(ValueError, match="stores something"):
        gemm_join(x, w, None, shape, (0, 0, k, 1), st, st, JoinEpilogue(swiglu_backward))
    with pytest.raises(TypeError, match="@triton.jit"):
        gemm_join(x, w, out, shape, (0, 0, k, 1), st, st, JoinEpilogue(lambda g: (g,)))
    assert [pair_fits(c) for c in (GemmConfig(128, 256, 64, 8, 3, 8), GemmConfig(128, 128, 64, 8, 4, 8),
                                   GemmConfig(128, 128, 64, 8, 4, 4), GemmConfig(128, 64, 64, 8, 4, 4))] == [False, True, False, True]


ROWS, D, F = 4 * 2048, 2048, 8192  # Llama-style: 4 sequences of 2048 tokens, hidden 2048, MLP 8192


@pytest.mark.gpu
def test_swiglu_join_at_llama_size():
    """Forward (stacked nn.Linear weight [2F, D]) and backward (W_down [D, F]) on every Hopper config
    that fits pair mode (forward) or the join's stores (backward), against float64."""
    gen = torch.Generator().manual_seed(7)
    dtype = torch.bfloat16
    x = randn(ROWS, D, gen=gen, dtype=dtype)
    w_gate_up = randn(2 * F, D, gen=gen, dtype=dtype) / math.sqrt(D)
    w_down = randn(D, F, gen=gen, dtype=dtype) / math.sqrt(F)
    dy = randn(ROWS, D, gen=gen, dtype=dtype)
    w0, w1 = w_gate_up[:F].T, w_gate_up[F:].T  # B[k, n] = W[n, k]: k-major
    references = _torch_forward(x.double(), w0.double(), w1.double())
    tolerances = [1.25 * error(t, r) + MARGIN[dtype] for t, r in zip(_torch_forward(x, w0, w1), references)]
    gate, up = (t.to(dtype) for t in references[:2])
    s = torch.nn.functional.silu(gate.float()).to(dtype)
    back_references = _torch_backward(dy.double(), w_down.double(), up.double(), s.double(), gate.double())
    back_tolerances = [1.25 * error(t, r) + MARGIN[dtype]
                       for t, r in zip(_torch_backward(dy, w_down, up, s, gate), back_references)]
    st = (0, 0, F, 1)
    for pair in (True, False):
        configs = dict.fromkeys(fitted(c, dtype, True, pair) for c in valid_configs(dtype))
        for config in filter(None, configs):
            outs = [torch.full((ROWS, F), float("nan"), dtype=dtype, device=DEVICE) for _ in range(4)]
            if pair:
                join = JoinEpilogue(swiglu_forward, b1=w1, stores=(outs[2], outs[3]), store_strides=(st, st),
                                    acc1=outs[1], acc1_strides=st)
                gemm_join(x, w0, outs[0], GemmShape(1, 1, ROWS, F, D), (0, 0, D, 1), (0, 0, 1, D), st, join, config=config)
                checks = zip(outs, references, tolerances)
            else:
                join = JoinEpilogue(swiglu_backward, loads=(up, s, gate), load_strides=(st,) * 3,
                                    stores=(outs[0], outs[1]), store_strides=(st, st))
                gemm_join(dy, w_down, None, GemmShape(1, 1, ROWS, F, D), (0, 0, D, 1), (0, 0, F, 1), st, join,
                     config=config)
                checks = zip(outs[:2], back_references, back_tolerances)
            for i, (out, reference, tolerance) in enumerate(checks):
                assert error(out, reference) <= tolerance, (pair, i, str(config))
