"""Direct cuBLAS calls (``kernels.blas``): the arguments ``DirectGemm`` derives from a GEMM's three
views, checked on the CPU by carrying them out as cuBLAS defines them (column-major, op N / T,
leading dims, batch strides) over the views' storage in float64; on the GPU (``-m gpu``) the
cuBLASLt call (``LtMatmul``) against PyTorch's ``addmm_`` / ``baddbmm_`` on the same views: the
same kernel, so bitwise equal; the heuristic's further algorithms against float64."""
import pytest
import torch

from datamove.kernels.blas import ALGORITHMS, OP_N, DirectGemm, LtMatmul, algorithm_count
from datamove.harness.sweep_variants import judge
from datamove.kernels.contraction import cublas_call, cublas_views, empty_in_layout, gemm_plan
from tests.test_contraction import EINSUMS, SMALL, _operands, _picked


def _flat(t: torch.Tensor) -> torch.Tensor:
    """``t``'s whole storage as a 1-D float64 tensor (element i = storage element i)."""
    return torch.empty(0, dtype=t.dtype, device=t.device).set_(t.untyped_storage()).double().cpu()


def _matrix(flat, start, op, rows, cols, ld):
    """op(M) for the column-major M cuBLAS reads at element ``start`` with leading dim ``ld``:
    a (rows, cols) tensor."""
    r = torch.arange(rows).unsqueeze(1)
    c = torch.arange(cols).unsqueeze(0)
    return flat[start + (r + c * ld if op == OP_N else c + r * ld)]


def _carry_out(gemm: DirectGemm, a_flat, b_flat, c_flat, offsets) -> None:
    """The cuBLAS call ``gemm`` describes, on flat storages, A/B/C's first elements at ``offsets``."""
    op_a, op_b, m, n, k, lda, ldb, ldc = gemm.args
    (first, f0), (second, s0), (out, c0) = gemm.operands(*zip((a_flat, b_flat, c_flat), offsets))
    sf, ss, sc = gemm.strides or (0, 0, 0)
    for i in range(gemm.batch):
        product = _matrix(first, f0 + i * sf, op_a, m, k, lda) @ _matrix(second, s0 + i * ss, op_b, k, n, ldb)
        r, c = torch.arange(m).unsqueeze(1), torch.arange(n).unsqueeze(0)
        out[c0 + i * sc + r + c * ldc] = product


def _views(plan, dtype, device="cpu", seed=0):
    a, b = _operands(plan, SMALL, dtype, seed, device)
    out = empty_in_layout(plan.contraction.out, plan.layouts[2], SMALL, dtype, device).fill_(float("nan"))
    return cublas_views(gemm_plan(plan.contraction.spec, a, b, out), a, b, out)


@pytest.mark.parametrize("spec", EINSUMS)
def test_derived_call_is_the_views_product(spec):
    derived = 0
    for plan in _picked(spec, SMALL, 6, blas_only=True):
        views = _views(plan, torch.bfloat16)
        if views is None:  # two batch dims: one call per index, not one DirectGemm
            continue
        va, vb, vc = views
        gemm = DirectGemm.derive(va, vb, vc)
        if gemm is None:
            continue
        derived += 1
        flats = [_flat(t) for t in views]
        _carry_out(gemm, *flats, [t.storage_offset() for t in views])
        result = flats[2].as_strided(vc.shape, vc.stride(), vc.storage_offset())
        assert torch.allclose(result, va.double() @ vb.double(), rtol=1e-12, atol=1e-12), plan.describe()
    assert derived, f"{spec}: no plan gave a direct call"


def test_refuses_what_it_cannot_express():
    x = torch.randn(6, 5, dtype=torch.bfloat16)
    assert DirectGemm.derive(x, torch.randn(5, 4, dtype=torch.bfloat16), torch.empty(6, 4, dtype=torch.bfloat16))
    assert DirectGemm.derive(x.float(), torch.randn(5, 4), torch.empty(6, 4)) is None  # fp32: TF32 settings
    assert DirectGemm.derive(x, torch.randn(5, 1, dtype=torch.bfloat16), torch.empty(6, 1, dtype=torch.bfloat16)) is None
    strided = torch.randn(6, 10, dtype=torch.bfloat16)[:, ::2]  # no unit stride
    assert DirectGemm.derive(strided, torch.randn(5, 4, dtype=torch.bfloat16), torch.empty(6, 4, dtype=torch.bfloat16)) is None
    assert LtMatmul.of(x, torch.randn(5, 4, dtype=torch.bfloat16), torch.empty(6, 4, dtype=torch.bfloat16)) is None  # CPU


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("spec", EINSUMS)
def test_direct_call_matches_pytorch(spec, dtype):
    called = 0
    for n, plan in enumerate(_picked(spec, SMALL, 6, blas_only=True)):
        views = _views(plan, dtype, "cuda", seed=n)
        gemm = views and LtMatmul.of(*views)
        if gemm is None:
            continue
        va, vb, vc = views
        expected = torch.empty_like(vc)
        cublas_call(va, vb, expected)
        gemm(va.data_ptr(), vb.data_ptr(), vc.data_ptr())
        torch.cuda.synchronize()
        assert torch.equal(vc, expected), plan.describe()
        called += 1
    assert called, f"{spec}: no plan gave a direct call"


@pytest.mark.gpu
@pytest.mark.parametrize("spec", EINSUMS)
def test_every_algorithm_of_the_heuristic_is_the_product(spec):
    """The heuristic's further algorithms (``ALGORITHMS``, which the tuning times): each the GEMM
    of the views, and with a residual added (C = A B + residual, beta 1), no farther from float64
    than PyTorch's ``@`` / ``addmm`` (the tuning's rule, ``harness.sweep_variants.judge``)."""
    called = 0
    for n, plan in enumerate(_picked(spec, SMALL, 6, blas_only=True)):
        views = _views(plan, torch.bfloat16, "cuda", seed=n)
        if views is None or LtMatmul.of(*views) is None:
            continue
        va, vb, vc = views
        base = torch.randn(vc.untyped_storage().nbytes() // vc.element_size(), dtype=vc.dtype, device=vc.device)
        added = base.as_strided(vc.shape, vc.stride(), vc.storage_offset())  # a residual laid out as C
        reference = va.double() @ vb.double()
        addmm = torch.addmm if vc.dim() == 2 else torch.baddbmm
        count = algorithm_count(*views, "cuda")
        assert 1 <= count <= ALGORITHMS
        for algorithm in range(count):
            gemm = LtMatmul.of(*views, algorithm)
            vc.fill_(float("nan"))
            gemm(va.data_ptr(), vb.data_ptr(), vc.data_ptr())
            closeness = judge(vc, va @ vb, reference)
            assert closeness.passed, (plan.describe(), algorithm, str(closeness))
            vc.fill_(float("nan"))
            gemm(va.data_ptr(), vb.data_ptr(), vc.data_ptr(), added.data_ptr())
            closeness = judge(vc, addmm(added, va, vb), reference + added.double())
            assert closeness.passed, (plan.describe(), algorithm, "residual", str(closeness))
            called += 1
    assert called, f"{spec}: no plan gave a direct call"


def test_kept_views_give_the_pointers_of_their_views():
    """``steps._KeptViews``: a cuBLAS step's operand views rebuilt per call, or their data
    pointers for a replay's direct call: the same addresses, views taken at an offset into their
    base included (a stacked operand's lowest member), and a stacked operand whose members no
    longer keep their distances is refused by both."""
    from datamove.layouts.plan import GEMM, Step
    from datamove.layouts.step_config import ContractionConfig
    from datamove.runtime.steps import _KeptViews

    step = Step("s", "forward", GEMM, (), {"a": "xy", "w0": "xy", "w1": "xy"}, {"c": "xy"},
                ContractionConfig("xy,yz->xz", "cublas", {"a": ["a"], "b": ["w0", "w1"], "out": ["c"]}), 0.0, "predicted")
    stacked = torch.randn(2, 6, 5, dtype=torch.bfloat16)
    store = {"a": torch.randn(7, 6, dtype=torch.bfloat16), "w0": stacked[1], "w1": stacked[0],
             "c": torch.empty(9, 7, dtype=torch.bfloat16)}
    members = [["a"], ["w0", "w1"], ["c"]]
    views = [store["a"].as_strided((3, 6), (6, 1), 6), stacked.as_strided((2, 5, 6), (30, 1, 5), 0),
             store["c"].as_strided((3, 5), (1, 9), 2)]
    kept = _KeptViews.derive(step, store, members, views)
    assert [o.offset for o in kept.operands] == [6, 0, 2] and kept.operands[1].base == 1  # w1, the lower member
    for call in range(2):  # the first store, then a new one allocated alike
        rebuilt = kept.views(store)
        assert [v.data_ptr() for v in rebuilt] == kept.pointers(store)
        assert all(r.shape == v.shape and r.stride() == v.stride() for r, v in zip(rebuilt, views))
        stacked = torch.randn(2, 6, 5, dtype=torch.bfloat16)
        store = {"a": torch.randn(7, 6, dtype=torch.bfloat16), "w0": stacked[1], "w1": stacked[0],
                 "c": torch.empty(9, 7, dtype=torch.bfloat16)}
    store["w0"] = torch.randn(6, 5, dtype=torch.bfloat16)  # a member elsewhere
    assert kept.views(store) is None and kept.pointers(store) is None
