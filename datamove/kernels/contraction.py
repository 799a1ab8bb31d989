"""Contraction variants: an einsum over named letters, in given storage layouts, as one (batched) GEMM.

A contraction is a two-operand einsum such as ``"phi,ibj->phbj"`` (``w[p,h,i] x[i,b,j] -> q[p,h,b,j]``)
with a size per letter.  A *layout* of an operand is an order of its letters: the storage order,
row-major, so the last letter has stride 1.  Tensors keep their letters in spec order (the einsum's
order); their strides say the layout (``empty_in_layout`` makes one, ``layout_of`` reads it back).

Mapping (``map_layouts``): letters fall into groups, batch (in A, B and the output), M (A and output),
N (B and output) and K (A and B).  A layout combination is a GEMM when, in every operand, each of
the M, N, K groups is a run of adjacent letters in the same relative order in all operands that
hold it, so the group flattens to one index with one stride; the batch letters flatten the same way
into one or two such runs (two strided batch dims).  The result, a ``GemmPlan``, gives
``C[b0, b1, m, n] = sum_k A[b0, b1, m, k] * B[b0, b1, k, n]`` as sizes and one stride per GEMM dim
for each operand.  ``enumerate_variants`` tries every permutation of every operand's letters.

Backends: ``run_cublas`` (torch mm/bmm with beta=0 on ``as_strided`` views of the operands' storage,
no copies; needs a unit-stride matrix dim in every operand) and ``run_triton`` (the template in
``kernels.gemm``, any strides, fused epilogue).  ``contract`` does parse + map + run.

Stacked (algebraic) contractions: ``stacked_spec`` adds a stack letter to an einsum, so the Q/K/V
projections sharing ``x`` run as one GEMM over stacked weights, ``"sphi,ibj->sphbj"``, with backward
``"sphi,sphbj->ibj"`` (dX) and ``"sphbj,ibj->sphi"`` (dW); ``stacked_projection`` runs the forward.
"""
from __future__ import annotations

import functools
import itertools
import math
from dataclasses import dataclass
from typing import Mapping, Sequence

import torch

from datamove.kernels import gemm as triton_gemm
from datamove.kernels.launch import check_offsets

ACTIVATIONS = ("none", "relu", "gelu")


@dataclass(frozen=True)
class Contraction:
    """A parsed two-operand einsum; every group is a set of letters (kept in spec order here)."""

    spec: str
    a: str  # letters of the first operand, spec order
    b: str  # letters of the second operand
    out: str  # letters of the output
    batch: tuple[str, ...]  # in a, b and out
    m: tuple[str, ...]  # in a and out only
    n: tuple[str, ...]  # in b and out only
    k: tuple[str, ...]  # in a and b only (summed)


def parse(spec: str) -> Contraction:
    """Parse ``"phi,ibj->phbj"``; every letter must be in exactly two operands, or in all three."""
    inputs, out = spec.replace(" ", "").split("->")
    a, b = inputs.split(",")
    for letters in (a, b, out):
        if len(set(letters)) != len(letters) or not letters.isalpha():
            raise ValueError(f"{spec!r}: operand {letters!r} must be distinct letters")
    for letter in set(a + b + out):
        if (letter in a) + (letter in b) + (letter in out) < 2:
            raise ValueError(f"{spec!r}: letter {letter!r} is in one operand only (a reduction, not a GEMM)")
    batch = tuple(x for x in a if x in b and x in out)
    m = tuple(x for x in a if x not in b)
    n = tuple(x for x in b if x not in a)
    k = tuple(x for x in a if x in b and x not in out)
    return Contraction(spec, a, b, out, batch, m, n, k)


def flops(contraction: Contraction, sizes: Mapping[str, int]) -> int:
    """Floating-point operations: 2 (multiply + add) x the product of the sizes of all letters."""
    return 2 * math.prod(sizes[x] for x in set(contraction.a + contraction.b + contraction.out))


def row_major_strides(layout: str, sizes: Mapping[str, int]) -> dict[str, int]:
    """Element stride of each letter for dense storage in ``layout`` order (last letter stride 1)."""
    strides, step = {}, 1
    for letter in reversed(layout):
        strides[letter] = step
        step *= sizes[letter]
    return strides


def empty_in_layout(letters: str, layout: str, sizes: Mapping[str, int], dtype=torch.float32, device="cpu") -> torch.Tensor:
    """Uninitialised tensor with dims in ``letters`` (spec) order, stored densely in ``layout`` order."""
    if sorted(letters) != sorted(layout):
        raise ValueError(f"layout {layout!r} is not a permutation of {letters!r}")
    storage = torch.empty([sizes[x] for x in layout], dtype=dtype, device=device)
    return storage.permute([layout.index(x) for x in letters])


def layout_of(tensor: torch.Tensor, letters: str) -> str:
    """The storage order of a tensor whose dims are ``letters``; raises unless it is dense in that order."""
    if tensor.dim() != len(letters):
        raise ValueError(f"tensor of {tensor.dim()} dims for letters {letters!r}")
    return _dense_order(tuple(tensor.shape), tensor.stride(), letters)


def stored_as(tensor: torch.Tensor, letters: str, layout: str) -> bool:
    """Whether a tensor whose dims are ``letters`` is dense in ``layout`` (the strides of letters of
    size 1, never used, may be anything)."""
    sizes = dict(zip(letters, tensor.shape))
    expected = row_major_strides(layout, sizes)
    return all(stride == expected[x] for x, stride in zip(letters, tensor.stride()) if sizes[x] > 1)


@functools.lru_cache(maxsize=4096)
def _dense_order(shape: tuple, strides: tuple, letters: str) -> str:
    """``layout_of`` for one (shape, strides): kept, as a layer's GEMM steps check the same few
    every call (host time per launch counts where nothing is graphed)."""
    order = sorted(range(len(letters)), key=lambda d: (-strides[d], d))
    layout = "".join(letters[d] for d in order)
    sizes = dict(zip(letters, shape))
    expected = row_major_strides(layout, sizes)
    if any(strides[d] != expected[x] for d, x in enumerate(letters) if sizes[x] > 1):
        raise ValueError(f"tensor with strides {strides} is not dense in any order of {letters!r}")
    return layout


@dataclass(frozen=True)
class GemmPlan:
    """A layout combination as ``C[b0, b1, m, n] = sum_k A[b0, b1, m, k] B[b0, b1, k, n]``.

    Group letters are listed outer to inner (their shared order).  Strides are in elements, for
    dense storage in ``layouts``; a missing dim has size 1 and the operand's element count as stride.
    ``a_transposed`` is True when A's unit stride is along m (A stored K x M), False when along k,
    None when A's innermost letter is a batch letter (no unit-stride matrix dim: not a BLAS GEMM);
    likewise ``b_transposed`` (unit stride along k: True, along n: False) and ``c_transposed``
    (unit stride along m: True, along n: False).
    """

    contraction: Contraction
    layouts: tuple[str, str, str]  # storage orders of A, B, output
    batch_letters: tuple[tuple[str, ...], tuple[str, ...]]  # letters of b0 and of b1
    m_letters: tuple[str, ...]
    n_letters: tuple[str, ...]
    k_letters: tuple[str, ...]
    batch: tuple[int, int]  # sizes of b0, b1
    m: int
    n: int
    k: int
    a_strides: tuple[int, int, int, int]  # (b0, b1, m, k)
    b_strides: tuple[int, int, int, int]  # (b0, b1, k, n)
    c_strides: tuple[int, int, int, int]  # (b0, b1, m, n)
    a_transposed: bool | None
    b_transposed: bool | None
    c_transposed: bool | None

    @property
    def blas(self) -> bool:
        """True when every operand has a unit-stride matrix dim, as cuBLAS needs."""
        return None not in (self.a_transposed, self.b_transposed, self.c_transposed)

    @property
    def batch_dims(self) -> int:
        return sum(1 for group in self.batch_letters if group)

    @property
    def flops(self) -> int:
        return 2 * self.batch[0] * self.batch[1] * self.m * self.n * self.k

    def describe(self) -> str:
        trans = "".join("?" if t is None else ("T" if t else "N") for t in (self.a_transposed, self.b_transposed, self.c_transposed))
        return (f"{self.layouts[0]},{self.layouts[1]}->{self.layouts[2]}: batch {self.batch[0]}x{self.batch[1]} "
                f"M={self.m} N={self.n} K={self.k} A/B/C {trans}")


@dataclass(frozen=True)
class NotAGemm:
    """A layout combination that does not map to one (batched) GEMM, and why."""

    layouts: tuple[str, str, str]
    reason: str


_OPERANDS = ("A", "B", "output")


def _run_in(layout: str, group: Sequence[str]) -> bool:
    """True when ``group`` (ordered) is a run of adjacent letters of ``layout`` in that order."""
    if not group:
        return True
    start = layout.find(group[0])
    return layout[start:start + len(group)] == "".join(group)


def _batch_groupings(batch: tuple[str, ...], layout_a: str) -> list[tuple[tuple[str, ...], tuple[str, ...]]]:
    """Candidate (b0, b1) groupings of the batch letters, from the runs they form in A's layout."""
    if not batch:
        return [((), ())]
    ordered = [x for x in layout_a if x in batch]
    runs, current = [], [ordered[0]]
    for x in ordered[1:]:
        if layout_a.index(x) == layout_a.index(current[-1]) + 1:
            current.append(x)
        else:
            runs.append(tuple(current))
            current = [x]
    runs.append(tuple(current))
    if len(runs) > 2:
        return []
    if len(runs) == 2:
        return [(runs[0], runs[1])]
    run = runs[0]
    return [(run, ())] + [(run[:cut], run[cut:]) for cut in range(1, len(run))]


def _group_stride(group: Sequence[str], strides: Mapping[str, int], numel: int) -> int:
    return strides[group[-1]] if group else numel


def map_layouts(contraction: Contraction | str, layouts: Sequence[str], sizes: Mapping[str, int]) -> GemmPlan | NotAGemm:
    """Map the layouts (storage orders of A, B, output) of a contraction to a GEMM, or say why not."""
    c = parse(contraction) if isinstance(contraction, str) else contraction
    layouts = tuple(layouts)
    for name, letters, layout in zip(_OPERANDS, (c.a, c.b, c.out), layouts):
        if sorted(letters) != sorted(layout):
            raise ValueError(f"{name} layout {layout!r} is not a permutation of {letters!r}")
    la, lb, lo = layouts
    holders = {"M": (c.m, (0, 2)), "N": (c.n, (1, 2)), "K": (c.k, (0, 1))}  # group: (letters, operands holding it)
    ordered = {}
    for name, (letters, holder) in holders.items():
        group = tuple(x for x in layouts[holder[0]] if x in letters)
        for where in holder:
            layout = layouts[where]
            if not _run_in(layout, group):
                in_order = tuple(x for x in layout if x in letters)
                if in_order != group:
                    why = f"in order {''.join(in_order)!r} where another operand has {''.join(group)!r}"
                else:
                    why = "not adjacent"
                return NotAGemm(layouts, f"{name} letters {''.join(group)!r} {why} in {_OPERANDS[where]} layout {layout!r}")
        ordered[name] = group
    groupings = [g for g in _batch_groupings(c.batch, la) if all(_run_in(lay, grp) for lay in (lb, lo) for grp in g)]
    if not groupings:
        return NotAGemm(layouts, f"batch letters {''.join(c.batch)!r} do not form at most two runs in the same order "
                                 f"in all layouts {la!r}, {lb!r}, {lo!r}")
    b0_letters, b1_letters = groupings[0]
    stride = [row_major_strides(layout, sizes) for layout in layouts]
    numel = [math.prod(sizes[x] for x in layout) for layout in layouts]

    def strides_of(i: int, dims: Sequence[Sequence[str]]) -> tuple[int, ...]:
        return tuple(_group_stride(g, stride[i], numel[i]) for g in dims)

    def transposed(layout: str, fast: Sequence[str], slow: Sequence[str]) -> bool | None:
        inner = layout[-1]
        return True if inner in slow else (False if inner in fast else None)

    m, n, k = ordered["M"], ordered["N"], ordered["K"]
    return GemmPlan(
        contraction=c,
        layouts=layouts,
        batch_letters=(b0_letters, b1_letters),
        m_letters=m,
        n_letters=n,
        k_letters=k,
        batch=(math.prod(sizes[x] for x in b0_letters), math.prod(sizes[x] for x in b1_letters)),
        m=math.prod(sizes[x] for x in m),
        n=math.prod(sizes[x] for x in n),
        k=math.prod(sizes[x] for x in k),
        a_strides=strides_of(0, (b0_letters, b1_letters, m, k)),
        b_strides=strides_of(1, (b0_letters, b1_letters, k, n)),
        c_strides=strides_of(2, (b0_letters, b1_letters, m, n)),
        a_transposed=transposed(la, k, m),
        b_transposed=transposed(lb, n, k),
        c_transposed=transposed(lo, n, m),
    )


@dataclass(frozen=True)
class Variants:
    """All layout combinations of a contraction: the plans of those that map, and those that don't."""

    contraction: Contraction
    plans: list[GemmPlan]
    unmappable: list[NotAGemm]

    @property
    def total(self) -> int:
        return len(self.plans) + len(self.unmappable)

    @property
    def blas_plans(self) -> list[GemmPlan]:
        return [p for p in self.plans if p.blas]


def enumerate_variants(contraction: Contraction | str, sizes: Mapping[str, int]) -> Variants:
    """Try every permutation of every operand's letters (A, B, output) as layouts."""
    c = parse(contraction) if isinstance(contraction, str) else contraction
    plans, unmappable = [], []
    for layouts in itertools.product(*(("".join(p) for p in itertools.permutations(x)) for x in (c.a, c.b, c.out))):
        result = map_layouts(c, layouts, sizes)
        (plans if isinstance(result, GemmPlan) else unmappable).append(result)
    return Variants(c, plans, unmappable)


def blas_plans(contraction: Contraction | str, sizes: Mapping[str, int]) -> list[GemmPlan]:
    """``enumerate_variants(contraction, sizes).blas_plans`` (in its order) without trying the layout
    combinations that cannot give one: an operand whose innermost letter is a batch letter, an A
    layout whose M or K letters are not adjacent, a B layout without K in A's order or with N apart,
    an output without M and N adjacent in A's and B's order (BERT's and Llama's GEMMs: 4.3 s of
    ``map_layouts`` calls for every combination)."""
    c = parse(contraction) if isinstance(contraction, str) else contraction

    def orders(letters: str, inner: str) -> list[str]:
        return ["".join(p) for p in itertools.permutations(letters) if p[-1] in inner]

    b_orders, out_orders = orders(c.b, c.k + c.n), orders(c.out, c.m + c.n)
    plans = []
    for la in orders(c.a, c.m + c.k):
        m, k = (tuple(x for x in la if x in group) for group in (c.m, c.k))
        if not (_run_in(la, m) and _run_in(la, k)):
            continue
        for lb in b_orders:
            n = tuple(x for x in lb if x in c.n)
            if not (_run_in(lb, k) and _run_in(lb, n)):
                continue
            for lo in out_orders:
                if _run_in(lo, m) and _run_in(lo, n):
                    result = map_layouts(c, (la, lb, lo), sizes)
                    if isinstance(result, GemmPlan) and result.blas:
                        plans.append(result)
    return plans


# ---------------------------------------------------------------------------------------------
# Running a plan


def _sizes_of(c: Contraction, a: torch.Tensor, b: torch.Tensor) -> dict[str, int]:
    sizes = dict(zip(c.a, a.shape))
    for letter, size in zip(c.b, b.shape):
        if sizes.setdefault(letter, size) != size:
            raise ValueError(f"letter {letter!r} is {sizes[letter]} in A but {size} in B")
    return sizes


def _views(plan: GemmPlan, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, dims=(0, 1, 2, 3)):
    """``as_strided`` views of the three operands' storage, no copies: their (b0, b1, rows, cols)
    dims, or those of them in ``dims`` (a batch dim of extent 1 left out saves indexing it)."""
    (b0, b1), m, n, k = plan.batch, plan.m, plan.n, plan.k
    for name, t, letters, layout in zip(_OPERANDS, (a, b, out), (plan.contraction.a, plan.contraction.b, plan.contraction.out), plan.layouts):
        if not stored_as(t, letters, layout):
            raise ValueError(f"{name} is stored as {layout_of(t, letters)!r}, the plan has {layout!r}")
    return tuple(t.as_strided([shape[d] for d in dims], [strides[d] for d in dims])
                 for t, shape, strides in ((a, (b0, b1, m, k), plan.a_strides), (b, (b0, b1, k, n), plan.b_strides),
                                           (out, (b0, b1, m, n), plan.c_strides)))


def _single_call_dims(plan: GemmPlan) -> tuple[int, ...] | None:
    """The (b0, b1, rows, cols) dims of the operand views of one cuBLAS call (``addmm_`` for two
    dims, ``baddbmm_`` for three), or None for two batch dims (one call per index of one)."""
    b0, b1 = plan.batch
    if b0 * b1 == 1:
        return (2, 3)
    if b1 == 1 or b0 == 1:
        return (0 if b1 == 1 else 1, 2, 3)
    return None


def cublas_views(plan: GemmPlan, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> tuple | None:
    """The three operand views (layouts checked) of ``run_cublas``'s single call, for
    ``cublas_call``; None where it makes one call per index of a batch dim."""
    if not plan.blas:
        raise ValueError(f"{plan.describe()}: a batch letter is innermost in an operand; cuBLAS needs a unit-stride matrix dim")
    dims = _single_call_dims(plan)
    return None if dims is None else _views(plan, a, b, out, dims)


def cublas_call(va: torch.Tensor, vb: torch.Tensor, vc: torch.Tensor, alpha: float = 1.0, beta: float = 0.0) -> None:
    """``vc = alpha * va @ vb + beta * vc`` in place on ``cublas_views``' views."""
    if vc.dim() == 2:
        vc.addmm_(va, vb, beta=beta, alpha=alpha)
    else:
        vc.baddbmm_(va, vb, beta=beta, alpha=alpha)


def run_cublas(plan: GemmPlan, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, alpha: float = 1.0) -> torch.Tensor:
    """``out = alpha * contraction(a, b)`` through torch's cuBLAS GEMMs, written in place into ``out``.

    ``a``, ``b``, ``out`` have dims in spec letter order, dense in the plan's layouts.  One batch dim:
    one ``addmm_``/``baddbmm_`` (beta=0) on strided views; two batch dims: one ``baddbmm_`` per index
    of the shorter one.  Raises ValueError for a plan that is not ``blas`` (torch would copy).
    """
    views = cublas_views(plan, a, b, out)
    if views is not None:
        cublas_call(*views, alpha=alpha)
        return out
    b0, b1 = plan.batch
    va, vb, vc = _views(plan, a, b, out)
    if b0 <= b1:
        for i in range(b0):
            vc[i].baddbmm_(va[i], vb[i], beta=0, alpha=alpha)
    else:
        for i in range(b1):
            vc[:, i].baddbmm_(va[:, i], vb[:, i], beta=0, alpha=alpha)
    return out


@dataclass(frozen=True)
class Epilogue:
    """Element-wise work fused after the GEMM, in this order, on ``y = alpha * acc``:

    ``y += bias`` (``bias`` has dims ``bias_letters``, a subset of output letters covering whole GEMM
    groups, any dense layout); optional save of y (``save="pre_activation"``); ``y = act(y)`` with
    ``activation`` in none/relu/gelu (tanh form); optional save (``save="pre_dropout"``); dropout with
    probability ``dropout_p``: element at logical row-major index n over the output's letters in spec
    order is kept as ``dataflow.dropout_mask`` decides for counter ``offset + n`` (``kernels.philox``), kept
    values scaled by ``dropout_scale(dropout_p)``.

    Or the backward of such work (``gradient`` relu / gelu; nothing above then but alpha):
    ``y = y * act'(factor)`` (``factor`` over all output letters, any dense layout; relu's
    derivative taken as ``factor_scale`` where the factor is positive, 0 elsewhere), and given
    ``sums`` (dims ``sum_letters``: the letters of the GEMM's m or n group), ``sums`` = y summed
    over the other output letters (in fp32, by a second kernel: ``kernels.gemm``).
    """

    alpha: float = 1.0
    bias: torch.Tensor | None = None
    bias_letters: str = ""
    activation: str = "none"
    dropout_p: float = 0.0
    seed: int = 0
    offset: int = 0
    save: str | None = None
    gradient: str = "none"
    factor: torch.Tensor | None = None
    factor_scale: float = 1.0
    sums: torch.Tensor | None = None
    sum_letters: str = ""


def _dim_strides(plan: GemmPlan, letters: str, tensor: torch.Tensor, what: str) -> tuple[int, int, int, int]:
    """Strides per output GEMM dim (b0, b1, m, n) of a tensor over a subset of the output letters."""
    sizes = dict(zip(letters, tensor.shape))
    strides = dict(zip(letters, tensor.stride()))
    result = []
    for group in (*plan.batch_letters, plan.m_letters, plan.n_letters):
        held = [x for x in group if x in letters]
        if not held:
            result.append(0)
            continue
        if len(held) != len(group):
            raise ValueError(f"{what} over {letters!r} covers part of the GEMM group {''.join(group)!r}")
        spanned = [x for x in group if sizes[x] != 1] or list(group[-1:])  # a letter of size 1 has any stride
        for outer, inner in zip(spanned, spanned[1:]):
            if strides[outer] != strides[inner] * sizes[inner]:
                raise ValueError(f"{what}: letters {''.join(group)!r} do not flatten to one stride in it")
        result.append(strides[spanned[-1]])
    return tuple(result)


def _sums_along(plan: GemmPlan, letters: str, sums: torch.Tensor) -> tuple[str, int]:
    """("m" or "n", element stride) of a sum over output letters ``letters``: the letters of the
    plan's m or n group, flattening to one stride in ``sums``."""
    for along, group in (("m", plan.m_letters), ("n", plan.n_letters)):
        if set(group) == set(letters):
            strides = _dim_strides(plan, letters, sums, "sums")
            return along, strides[2] if along == "m" else strides[3]
    raise ValueError(f"sums over {letters!r}: not the letters of the GEMM's m group {''.join(plan.m_letters)!r} "
                     f"or n group {''.join(plan.n_letters)!r} in this layout")


def dropout_digits(plan: GemmPlan, sizes: Mapping[str, int]) -> tuple[tuple[int, int, int, int, int], ...]:
    """Per output GEMM dim (b0, b1, m, n): ``(q1, q2, l0, l1, l2)`` giving the logical index term.

    A GEMM dim's flat index f (its letters outer to inner) contributes
    ``(f % q1) * l0 + ((f // q1) % q2) * l1 + (f // (q1 * q2)) * l2`` to the element's logical
    row-major index over the output letters in spec order.  Letters that are also consecutive in
    spec order merge into one digit; at most three digits per GEMM dim.
    """
    logical = row_major_strides(plan.contraction.out, sizes)
    result = []
    for group in (*plan.batch_letters, plan.m_letters, plan.n_letters):
        digits = []  # (size, logical stride), inner to outer
        for letter in reversed(group):
            if digits and logical[letter] == digits[-1][0] * digits[-1][1]:
                digits[-1] = (digits[-1][0] * sizes[letter], digits[-1][1])
            else:
                digits.append((sizes[letter], logical[letter]))
        if len(digits) > 3:
            raise ValueError(f"GEMM group {''.join(group)!r} needs {len(digits)} digits for the dropout index (at most 3)")
        digits += [(1, 0)] * (3 - len(digits))
        (q1, l0), (q2, l1), (_, l2) = digits
        result.append((q1, q2, l0, l1, l2))
    return tuple(result)


def run_triton(plan: GemmPlan, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, epilogue: Epilogue = Epilogue(),
               config: triton_gemm.GemmConfig | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Run the plan through the Triton template (``kernels.gemm``) with a fused epilogue.

    Returns ``out``, or ``(out, saved)`` when ``epilogue.save`` is set (``saved`` in out's layout).
    """
    if epilogue.activation not in ACTIVATIONS:
        raise ValueError(f"activation {epilogue.activation!r} not in {ACTIVATIONS}")
    _views(plan, a, b, out)  # checks the layouts
    c = plan.contraction
    sizes = _sizes_of(c, a, b)
    bias_strides = (0, 0, 0, 0)
    if epilogue.bias is not None:
        bias_strides = _dim_strides(plan, epilogue.bias_letters, epilogue.bias, "bias")
    saved = None
    if epilogue.save is not None:
        saved = empty_in_layout(c.out, plan.layouts[2], sizes, out.dtype, out.device)
    digits = dropout_digits(plan, sizes) if epilogue.dropout_p > 0 else None
    factor_strides = (0, 0, 0, 0)
    if epilogue.factor is not None:
        factor_strides = _dim_strides(plan, c.out, epilogue.factor, "factor")
    sums_along, sums_stride = "none", 1
    if epilogue.sums is not None:
        sums_along, sums_stride = _sums_along(plan, epilogue.sum_letters, epilogue.sums)
    check_offsets("the Triton GEMM", a, b, out, epilogue.bias, saved, epilogue.factor, epilogue.sums)
    triton_gemm.gemm(
        a, b, out, triton_gemm.GemmShape(*plan.batch, plan.m, plan.n, plan.k), plan.a_strides, plan.b_strides, plan.c_strides,
        alpha=epilogue.alpha, bias=epilogue.bias, bias_strides=bias_strides, activation=epilogue.activation,
        dropout_p=epilogue.dropout_p, seed=epilogue.seed, offset=epilogue.offset, dropout_digits=digits,
        saved=saved, saved_strides=plan.c_strides, save=epilogue.save, gradient=epilogue.gradient,
        factor=epilogue.factor, factor_strides=factor_strides, factor_scale=epilogue.factor_scale,
        sums=epilogue.sums, sums_along=sums_along, sums_stride=sums_stride, config=config)
    return out if saved is None else (out, saved)


def gemm_plan(spec: str, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> GemmPlan:
    """The ``GemmPlan`` of einsum ``spec`` for the layouts ``a``, ``b`` and ``out`` are stored in (read from
    their strides), a BLAS one where a placement of the letters of size 1 gives one (``unit_placements``:
    at s = t = 1 the scores 'stbh' are the storage of 'bhst'); raises ValueError with the reason when
    that combination is not a GEMM."""
    c = parse(spec)
    sizes = _sizes_of(c, a, b)
    layouts = (layout_of(a, c.a), layout_of(b, c.b), layout_of(out, c.out))
    result = map_layouts(c, layouts, sizes)
    if isinstance(result, GemmPlan) and result.blas:
        return result
    placed = (m for m in map(lambda each: map_layouts(c, each, sizes), unit_placements(layouts, sizes))
              if isinstance(m, GemmPlan))
    first = None
    for mapped in placed:
        if mapped.blas:
            return mapped
        first = first or mapped
    if isinstance(result, GemmPlan):
        return result
    if first is None:
        raise ValueError(f"{spec} with layouts {result.layouts}: {result.reason}")
    return first


UNIT_PLACEMENTS = 4096  # layouts tried at most where letters of size 1 could sit anywhere


def unit_placements(layouts: Sequence[str], sizes: Mapping[str, int]):
    """The layouts that store tensors as ``layouts`` do, with each letter of size 1 moved elsewhere:
    such a letter's stride is never used, so strides cannot tell where it sits (``layout_of`` puts it
    by its stride, which ties with a neighbour's), and one of its places may map to a GEMM where
    another does not (GPT-2 at B=1: 'thbes' and 'thebs' are one storage)."""
    choices = []
    for layout in layouts:
        units = [x for x in layout if sizes[x] == 1]
        rest = "".join(x for x in layout if sizes[x] != 1)
        options = [rest]
        for unit in units:
            options = [o[:i] + unit + o[i:] for o in options for i in range(len(o) + 1)]
        choices.append(options)
    return itertools.islice(itertools.product(*choices), UNIT_PLACEMENTS)


def contract(spec: str, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor | None = None, *, out_layout: str | None = None,
             backend: str = "cublas", alpha: float = 1.0, epilogue: Epilogue | None = None,
             config: triton_gemm.GemmConfig | None = None):
    """Einsum ``spec`` of ``a`` and ``b`` (dims in spec order, layouts read from their strides) as one GEMM.

    The output is ``out`` or a new tensor stored in ``out_layout`` (default: spec order).  ``backend``
    is "cublas" (alpha only) or "triton" (``epilogue``, whose alpha is used; ``alpha`` must stay 1).
    Raises ValueError with the reason when the layout combination is not a GEMM.
    """
    c = parse(spec)
    if out is None:
        out = empty_in_layout(c.out, out_layout or c.out, _sizes_of(c, a, b), a.dtype, a.device)
    result = gemm_plan(spec, a, b, out)
    if backend == "cublas":
        if epilogue is not None:
            raise ValueError("the cuBLAS path fuses only alpha; run the epilogue with backend='triton'")
        return run_cublas(result, a, b, out, alpha)
    if backend == "triton":
        if alpha != 1.0:
            raise ValueError("with backend='triton', give alpha in the Epilogue")
        return run_triton(result, a, b, out, epilogue or Epilogue(), config)
    raise ValueError(f"unknown backend {backend!r}")


# ---------------------------------------------------------------------------------------------
# Stacked (algebraic) contractions


def stacked_spec(spec: str, stacked: Sequence[int], letter: str = "s") -> str:
    """Add stack letter ``letter`` in front of the operands numbered in ``stacked`` (0: A, 1: B).

    The output gets the letter too unless both inputs have it (then it is summed over):
    ``stacked_spec("phi,ibj->phbj", [0]) == "sphi,ibj->sphbj"``,
    ``stacked_spec("phi,phbj->ibj", [0, 1]) == "sphi,sphbj->ibj"``,
    ``stacked_spec("phbj,ibj->phi", [0]) == "sphbj,ibj->sphi"``.
    """
    if letter in spec:
        raise ValueError(f"stack letter {letter!r} already in {spec!r}")
    inputs, out = spec.split("->")
    operands = [letter + x if i in stacked else x for i, x in enumerate(inputs.split(","))]
    return f"{','.join(operands)}->{out if len(set(stacked)) == 2 else letter + out}"


def stacked_projection(spec: str, weights: torch.Tensor, x: torch.Tensor, out_layout: str | None = None, **kwargs) -> list[torch.Tensor]:
    """Several projections ``spec`` of one input ``x`` (e.g. Q, K, V: ``"phi,ibj->phbj"``) as ONE GEMM.

    ``weights`` has the stack letter "s" first in its dims (``[s, p, h, i]`` for the example, any dense
    layout); ``out_layout`` orders the stacked output's letters (``"sphbj"`` by default).  Returns
    the ``weights.shape[0]`` projections, views of the one stacked output (a pair of such lists,
    outputs and saved values, when the epilogue saves).  ``kwargs`` go to ``contract``.
    """
    stacked = contract(stacked_spec(spec, [0]), weights, x, out_layout=out_layout, **kwargs)
    if isinstance(stacked, tuple):  # (out, saved) from an epilogue that saves
        return tuple(list(t.unbind(0)) for t in stacked)
    return list(stacked.unbind(0))
