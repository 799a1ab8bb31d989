"""Fused attention vs a float64 PyTorch reference that regenerates the dropout mask in NumPy.

CPU (Triton interpreter): odd sizes B=2, H=3, Lq=37, Lk=29 with head dims 16 and 64 (one Philox
call per element), and key counts that are multiples of 8 where the mask is drawn one call per
eight keys (``test_dropout_paths``, ``test_config_space_runs``, a low-precision case); every test
checks O and all three gradients, with the backward regenerating the mask (the default) and, in
``test_dropout_paths`` and the configuration space, reading the mask the forward saved (one byte
per eight keys, compared bit for bit with NumPy's). Grouped-query attention (``test_gqa_*``): 6 query
heads over 2 or 3 K/V heads (4 over 2 with a padding mask and a saved mask, 8 over 2 in bf16), K/V
and dK/dV over the K/V heads, against float64 with K/V repeated first. GPU (``gpu`` marker):
BERT-large sizes in bf16 with dropout 0.1, both mask options; Llama sizes (32 query heads over 8
K/V heads, head dims 64 and 128) for grouped-query attention.
"""
import functools
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from datamove.dataflow.dropout_mask import dropout_scale, keep_mask
from datamove.harness.accuracy import assert_closer, relative_error
from datamove.kernels.attention import (DROPOUT_MASK_OPTIONS, attention_backward, attention_configs, attention_forward,
                               default_config, dropout_grouped, dropout_strides_for, fused_attention, new_saved_mask)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# fp32 operands: exact products in the interpreter, TF32 dots on a GPU
FP32_TOL = 3e-3 if DEVICE == "cuda" else 1e-5


def stored_as(t: torch.Tensor, order: str) -> torch.Tensor:
    """The logical (b, h, j, p) tensor ``t`` stored in dim order ``order``, returned as a logical view."""
    perm = ["bhjp".index(d) for d in order]
    stored = t.permute(perm).contiguous()
    return stored.permute([order.index(d) for d in "bhjp"])


@functools.lru_cache(maxsize=4)
def probability_keep(seed, offset, p, B, H, Lq, Lk, order="bhjk"):
    """Keep mask (b, h, j, k) built in the probabilities' spec order ``order``, then permuted."""
    sizes = dict(b=B, h=H, j=Lq, k=Lk)
    mask = keep_mask(seed, offset, tuple(sizes[d] for d in order), p)
    return torch.from_numpy(mask).permute([order.index(d) for d in "bhjk"])


def saved_bits(keep):
    """The bits a forward saves for the keep mask ``keep`` (b, h, j, k) bool, int16 (b, h, j, k // 16):
    bit 2 i + e of [b, h, j, c] = the decision of key 64 (c // 4) + 8 i + 2 (c % 4) + e
    (``kernels.attention``'s module doc)."""
    B, H, Lq, Lk = keep.shape
    grouped = keep.cpu().numpy().reshape(B, H, Lq, Lk // 64, 8, 4, 2).swapaxes(-2, -3)  # [.., G, i, t, e] -> [.., G, t, i, e]
    bits = grouped.reshape(B, H, Lq, Lk // 16, 16).astype(np.uint32) << np.arange(16, dtype=np.uint32)
    return torch.from_numpy(bits.sum(-1).astype(np.uint16).view(np.int16))


def eager_attention(q, k, v, *, scale, dropout_p, seed, offset, causal=False, key_padding_mask=None, order="bhjk"):
    """The unfused chain at the inputs' precision, with the kernel's dropout mask; k and v over
    fewer heads than q (grouped-query attention) repeated over the query heads first, as HF's
    ``repeat_kv`` does (their gradients then sum over each group)."""
    B, H, Lq, _ = q.shape
    Lk = k.shape[2]
    if k.shape[1] != H:
        k, v = (t.repeat_interleave(H // k.shape[1], dim=1) for t in (k, v))
    s = torch.einsum("bhjp,bhkp->bhjk", q, k) * scale
    if causal:
        s = s.masked_fill(torch.ones(Lq, Lk, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    if key_padding_mask is not None:
        s = s.masked_fill(key_padding_mask[:, None, None, :], float("-inf"))
    a = torch.softmax(s, dim=-1)
    if dropout_p > 0:
        keep = probability_keep(seed, offset, dropout_p, B, H, Lq, Lk, order).to(q.device)
        a = a * keep.to(a.dtype) * dropout_scale(dropout_p)
    return torch.einsum("bhjk,bhkp->bhjp", a, v)


def make_inputs(B, H, Lq, Lk, P, dtype, layout="bhjp", seed=0, KV=None):
    """Float64 q, k, v (k and v over ``KV`` heads, default H) and do; the kernel's q, k, v in
    ``dtype`` stored in ``layout``."""
    gen = torch.Generator().manual_seed(seed)
    q, do = (torch.randn(B, H, Lq, P, generator=gen, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(B, KV or H, Lk, P, generator=gen, dtype=torch.float64) for _ in range(2))
    kernel_inputs = [stored_as(t.to(DEVICE, dtype), layout).requires_grad_() for t in (q, k, v)]
    return (q, k, v), kernel_inputs, do


def padding_mask(B, Lk, seed=1):
    mask = torch.rand(B, Lk, generator=torch.Generator().manual_seed(seed)) < 0.3
    mask[:, 0] = False  # every row keeps a key (a fully padded row is tested on its own)
    return mask


def run_both(ref_inputs, kernel_inputs, do, baseline_dtype=None, **kwargs):
    """Kernel and float64 reference (and, with ``baseline_dtype``, the eager chain at that dtype):
    lists [O, dQ, dK, dV] for each."""
    forward_config = kwargs.pop("forward_config", None)
    backward_config = kwargs.pop("backward_config", None)
    order = kwargs.pop("order", "bhjk")
    B, H, Lq, _ = ref_inputs[0].shape
    strides = dropout_strides_for(order, B, H, Lq, ref_inputs[1].shape[2])
    o = fused_attention(*kernel_inputs, dropout_strides=strides, forward_config=forward_config,
                        backward_config=backward_config, **kwargs)
    o.backward(stored_as(do.to(DEVICE, o.dtype), "pjhb"))  # dO in yet another layout
    got = [o] + [t.grad for t in kernel_inputs]

    def chain(dtype, device):
        ins = [t.detach().to(device, dtype).requires_grad_() for t in ref_inputs]
        kpm = kwargs.get("key_padding_mask")
        args = dict(kwargs, key_padding_mask=None if kpm is None else kpm.to(device), order=order)
        out = eager_attention(*ins, **args)
        out.backward(do.to(device, dtype))
        return [out] + [t.grad for t in ins]

    reference = chain(torch.float64, DEVICE)
    baseline = chain(baseline_dtype, DEVICE) if baseline_dtype is not None else None
    return got, reference, baseline


NAMES = ("O", "dQ", "dK", "dV")


@pytest.fixture(autouse=True)
def interpreter_bf16_as_on_gpu(monkeypatch):
    """Two bf16 faults of Triton 3.9's interpreter, mended to match the GPU: dots multiply the
    operands' raw uint16 bit patterns (widen them to fp32 first, exact, as the bf16 MMA with fp32
    accumulation computes) and fp32 -> bf16 casts truncate (round to nearest even instead)."""
    if DEVICE != "cpu":
        return
    import triton.language as tl
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    create_dot, cast_impl = builder.create_dot, builder.cast_impl

    def widen(x):
        if x.dtype == tl.bfloat16:
            return interpreter.TensorHandle((x.data.astype(np.uint32) << 16).view(np.float32), tl.float32)
        return x

    def dot_widened(self, a, b, d, *args):
        return create_dot(self, widen(a), widen(b), d, *args)

    def cast_rounded(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            bits = src.data.astype(np.float32).view(np.uint32).astype(np.uint64)
            return interpreter.TensorHandle(((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16),
                                            tl.bfloat16)
        return cast_impl(self, src, dst_type)

    monkeypatch.setattr(builder, "create_dot", dot_widened)
    monkeypatch.setattr(builder, "cast_impl", cast_rounded)


@pytest.mark.parametrize("layout", ["bhjp", "bjhp"])
@pytest.mark.parametrize("dropout_p", [0.0, 0.2])
@pytest.mark.parametrize("mask", ["none", "causal", "padding"])
def test_matches_float64(mask, dropout_p, layout):
    B, H, Lq, Lk, P = 2, 3, 37, 29, 16
    ref_inputs, kernel_inputs, do = make_inputs(B, H, Lq, Lk, P, torch.float32, layout)
    got, reference, _ = run_both(ref_inputs, kernel_inputs, do, scale=0.3, dropout_p=dropout_p, seed=1234,
                                 offset=77, causal=mask == "causal",
                                 key_padding_mask=padding_mask(B, Lk).to(DEVICE) if mask == "padding" else None)
    for name, g, r in zip(NAMES, got, reference):
        assert g.shape == r.shape
        assert relative_error(g, r) < FP32_TOL, f"{name}: {relative_error(g, r):.2e}"


@pytest.mark.parametrize("mask", ["causal", "padding"])
def test_split_dq_kernel_paper_layout(mask):
    """dQ from its own kernel over j-blocks; tensors stored (p, h, b, j) as in the paper."""
    B, H, Lq, Lk, P = 2, 3, 37, 29, 16
    ref_inputs, kernel_inputs, do = make_inputs(B, H, Lq, Lk, P, torch.float32, "phbj", seed=3)
    got, reference, _ = run_both(ref_inputs, kernel_inputs, do, scale=0.25, dropout_p=0.2, seed=99, offset=0,
                                 causal=mask == "causal",
                                 key_padding_mask=padding_mask(B, Lk).to(DEVICE) if mask == "padding" else None,
                                 backward_config=dict(dq_mode="split"))
    for name, g, r in zip(NAMES, got, reference):
        assert relative_error(g, r) < FP32_TOL, f"{name}: {relative_error(g, r):.2e}"


def test_dropout_index_in_spec_order():
    """Probabilities whose spec order is (h, b, j, k): the mask follows that logical index."""
    B, H, Lq, Lk, P = 2, 3, 37, 29, 16
    ref_inputs, kernel_inputs, do = make_inputs(B, H, Lq, Lk, P, torch.float32, "bjhp", seed=4)
    got, reference, _ = run_both(ref_inputs, kernel_inputs, do, scale=0.25, dropout_p=0.3, seed=2024, offset=5,
                                 order="hbjk")
    for name, g, r in zip(NAMES, got, reference):
        assert relative_error(g, r) < FP32_TOL, f"{name}: {relative_error(g, r):.2e}"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("P,Lq,Lk,offset,causal", [(16, 37, 29, 11, False), (64, 23, 24, 16, True)])
def test_low_precision_acceptance(dtype, P, Lq, Lk, offset, causal):
    """bf16/fp16: no farther from float64 than PyTorch's eager chain at that precision (harness.accuracy);
    the mask drawn one Philox call per element (Lk = 29) or per eight keys (Lk = 24)."""
    B, H = 2, 3
    ref_inputs, kernel_inputs, do = make_inputs(B, H, Lq, Lk, P, dtype, "bjhp", seed=5)
    got, reference, baseline = run_both(ref_inputs, kernel_inputs, do, baseline_dtype=dtype, scale=P**-0.5,
                                        dropout_p=0.1, seed=7, offset=offset, causal=causal)
    for name, g, r, base in zip(NAMES, got, reference, baseline):
        assert g.dtype == dtype
        assert_closer(g, base, r, what=name)


@pytest.mark.parametrize("Lk,order,offset,grouped", [(64, "bhjk", 128, True), (128, "hbjk", 0, True),
                                                    (64, "bhjk", 8, False), (72, "bhjk", 0, False),
                                                    (29, "hbjk", 0, False), (64, "bhkj", 0, False)])
def test_dropout_paths(Lk, order, offset, grouped):
    """One Philox call per sixteen keys (mask's last letter k, rows on whole groups of 64) or one per element:
    O and every gradient right with the mask regenerated by the backward or saved by the forward
    (a bit per key, NumPy's mask bit for bit) and read by the backward, in both dQ modes."""
    B, H, Lq, P = 2, 2, 23, 16
    strides = dropout_strides_for(order, B, H, Lq, Lk)
    assert dropout_grouped(strides, offset) == grouped
    args = dict(scale=0.3, dropout_p=0.3, seed=4321, offset=offset)
    ref_inputs, kernel_inputs, do = make_inputs(B, H, Lq, Lk, P, torch.float32, "bjhp", seed=12)
    got, reference, _ = run_both(ref_inputs, kernel_inputs, do, order=order, **args)  # regenerated, atomic dQ
    for name, g, r in zip(NAMES, got, reference):
        assert relative_error(g, r) < FP32_TOL, f"{name}: {relative_error(g, r):.2e}"
    args["dropout_strides"] = strides
    q, k, v = (t.detach() for t in kernel_inputs)
    saved = new_saved_mask(q, k, dropout_p=0.3, offset=offset, dropout_strides=strides)
    assert (saved is not None) == grouped
    o, lse = attention_forward(q, k, v, **args, saved_mask=saved)
    assert torch.equal(o, got[0].detach())
    if grouped:  # the saved bits: bit 2 i + e of [b, h, j, c] = decision of key 64 (c // 4) + 8 i + 2 (c % 4) + e
        assert torch.equal(saved.cpu(), saved_bits(probability_keep(4321, offset, 0.3, B, H, Lq, Lk, order)))
    do_dev = do.to(DEVICE, torch.float32)
    # per element nothing is saved (new_saved_mask gives None): "saved" launches the kernels "regenerate" does
    backwards = [("split", "regenerate")]
    if grouped:
        backwards += [("atomic", "saved"), ("split", "saved")]
    for dq_mode, option in backwards:
        grads = attention_backward(do_dev, q, k, v, o, lse, **args, saved_mask=saved if option == "saved" else None,
                                   dq_mode=dq_mode, dropout_mask=option)
        for name, g, r in zip(NAMES[1:], grads, reference[1:]):
            assert relative_error(g, r) < FP32_TOL, f"{dq_mode} {option} {name}: {relative_error(g, r):.2e}"


@pytest.mark.parametrize("dq_mode", ["atomic", "split"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_biases_folded_in(dq_mode, dtype):
    """``bias=(bq, bv)``: the kernels attend over q + bq, k + bk, v + bv for any bk (BERT's Q/K/V bias
    add folded in; k's bias shifts each row's scores by one constant), the forward writing q + bq
    for the backward (which gets v's bias): O and dQ, dK, dV (the gradients of the unbiased q, k, v) against float64 with all three biases, bk nonzero, a key
    padding mask and dropout.  fp32 within the fp32 tolerance; bf16 no farther than PyTorch's eager
    chain at bf16 adding the same biases (the H200 tuning of 2026-11-25 judged a kernel that added
    bk wrong at BERT-large B=8 L=512: dQ 1.5e-2 from float64 against PyTorch's 9.7e-3)."""
    B, H, Lq, Lk, P = 2, 3, 37, 29, 16
    args = dict(scale=0.25, dropout_p=0.2, seed=77, offset=5, key_padding_mask=padding_mask(B, Lk).to(DEVICE))
    ref_inputs, kernel_inputs, do = make_inputs(B, H, Lq, Lk, P, dtype, "bjhp", seed=21)
    gen = torch.Generator().manual_seed(22)
    biases64 = [torch.randn(H, P, generator=gen, dtype=torch.float64).to(dtype).to(DEVICE, torch.float64) for _ in range(3)]
    bq, bv = (b.to(dtype).t().contiguous().t() for b in (biases64[0], biases64[2]))  # (h, p) views, p outer in memory
    q, k, v = (t.detach() for t in kernel_inputs)
    do_dev = stored_as(do.to(DEVICE, dtype), "pjhb")
    q_biased = torch.empty_like(q)
    o, lse = attention_forward(q, k, v, **args, bias=(bq, bv), q_biased=q_biased)
    assert torch.equal(q_biased, (q.float() + bq.float()[None, :, None, :]).to(dtype))  # rounded as a bias add stores it
    grads = attention_backward(do_dev, q_biased, k, v, o, lse, **args, v_bias=bv, dq_mode=dq_mode)

    def chain(precision):
        leaves = [t.detach().to(DEVICE, precision).requires_grad_() for t in ref_inputs]
        out = eager_attention(*(t + b.to(precision)[None, :, None, :] for t, b in zip(leaves, biases64)), **args)
        out.backward(do.to(DEVICE, precision))
        return [out] + [t.grad for t in leaves]

    reference = chain(torch.float64)
    baseline = chain(dtype) if dtype != torch.float32 else [None] * 4
    for name, got, want, base in zip(NAMES, (o, *grads), reference, baseline):
        if base is None:
            assert relative_error(got, want) < FP32_TOL, f"{name}: {relative_error(got, want):.2e}"
        else:
            assert_closer(got, base, want, what=name)
    with pytest.raises(ValueError, match=r"bias must be \(bq, bv\) with q_biased"):
        attention_forward(q, k, v, **args, bias=(bq, bv))
    with pytest.raises(ValueError, match=r"each \(h, p\): \(3, 16\)"):
        attention_forward(q, k, v, **args, bias=(bq, bv[:2]), q_biased=q_biased)
    with pytest.raises(ValueError, match=r"v_bias must be \(h, p\): \(3, 16\)"):
        attention_backward(do_dev, q_biased, k, v, o, lse, **args, v_bias=bv.t())


def test_config_space_runs():
    """Interpreter configurations of both passes compute the same, right result (Lk = 64: the mask
    drawn one Philox call per sixteen keys where the key blocks are whole groups of 64, so "saved",
    offered only there, saves it)."""
    B, H, Lq, Lk, P = 1, 2, 37, 64, 16
    forward, backward = attention_configs(P, "forward"), attention_configs(P, "backward")
    assert default_config(P, "forward") in forward and default_config(P, "backward") in backward
    assert {c["dq_mode"] for c in backward} == {"atomic", "split"}
    assert {c["dropout_mask"] for c in backward} == set(DROPOUT_MASK_OPTIONS) == {"regenerate", "saved"}
    whole = [c for c in forward if c["block_k"] % 64 == 0]
    assert len(backward) == 2 * len(forward) + 2 * len(whole)  # per tile: two dQ modes x the mask options it allows
    assert all(c["block_k"] % 64 == 0 for c in backward if c["dropout_mask"] == "saved")
    # the defaults run in every other test; here every fourth backward config, with a forward that can serve it
    for i in range(0, len(backward), 4):
        bwd = backward[i]
        fwd = (whole if bwd["dropout_mask"] == "saved" else forward)[i // 4 % (len(whole) if bwd["dropout_mask"] == "saved"
                                                                              else len(forward))]
        ref_inputs, kernel_inputs, do = make_inputs(B, H, Lq, Lk, P, torch.float32, seed=6)
        got, reference, _ = run_both(ref_inputs, kernel_inputs, do, scale=0.3, dropout_p=0.2, seed=5, offset=0,
                                     causal=True, forward_config=fwd, backward_config=bwd)
        for name, g, r in zip(NAMES, got, reference):
            assert relative_error(g, r) < FP32_TOL, f"{name} {fwd} {bwd}: {relative_error(g, r):.2e}"


def test_seeds_give_different_masks():
    """V = identity makes O[b,h,j,k] = P~[b,h,j,k]: the mask is where O != 0."""
    B, H, Lq, Lk, p = 2, 2, 48, 64, 0.25
    gen = torch.Generator().manual_seed(8)
    q = torch.randn(B, H, Lq, Lk, generator=gen).to(DEVICE)
    k = torch.randn(B, H, Lk, Lk, generator=gen).to(DEVICE)
    v = torch.eye(Lk).expand(B, H, Lk, Lk).to(DEVICE)
    masks = {}
    for seed, offset in ((1, 0), (2, 0), (1, 1000)):
        o, _ = attention_forward(q, k, v, scale=0.1, dropout_p=p, seed=seed, offset=offset)
        masks[seed, offset] = (o != 0).cpu()
        assert torch.equal(masks[seed, offset], probability_keep(seed, offset, p, B, H, Lq, Lk))
        assert abs(masks[seed, offset].float().mean().item() - (1 - 64 / 256)) < 0.02
    assert not torch.equal(masks[1, 0], masks[2, 0])
    assert not torch.equal(masks[1, 0], masks[1, 1000])
    assert (masks[1, 0] != masks[2, 0]).float().mean() > 0.2


@pytest.mark.parametrize("dq_mode,option", [("atomic", "regenerate"), ("split", "regenerate"), ("atomic", "saved")])
def test_padded_tails_skip_whole_key_blocks(dq_mode, option):
    """Keys after the last one the padding mask keeps are skipped a block at a time (the forward's
    and dQ's loops end there, the dK/dV programs of those blocks run no queries): O and every
    gradient as float64, padded keys' gradients exactly zero; tails cover zero, one and two of
    three key blocks (one ending right after a block's first key), with holes before them."""
    B, H, Lq, Lk, P = 3, 2, 19, 150, 16
    kpm = padding_mask(B, Lk, seed=5)
    for b, kept in enumerate((40, 150, 129)):  # the last kept key of batch 2 opens the third block of 64
        kpm[b, kept:] = True
    args = dict(scale=0.3, dropout_p=0.2, seed=77, offset=0)
    ref_inputs, kernel_inputs, do = make_inputs(B, H, Lq, Lk, P, torch.float32, "bhjp", seed=6)
    got, reference, _ = run_both(ref_inputs, kernel_inputs, do, key_padding_mask=kpm.to(DEVICE), **args)
    for name, g, r in zip(NAMES, got, reference):
        assert relative_error(g, r) < FP32_TOL, f"{name}: {relative_error(g, r):.2e}"
    q, k, v = (t.detach() for t in kernel_inputs)
    saved = new_saved_mask(q, k, dropout_p=0.2, offset=0) if option == "saved" else None
    o, lse = attention_forward(q, k, v, **args, key_padding_mask=kpm.to(DEVICE), saved_mask=saved)
    grads = attention_backward(do.to(DEVICE, torch.float32), q, k, v, o, lse, **args, key_padding_mask=kpm.to(DEVICE),
                               saved_mask=saved, dq_mode=dq_mode, dropout_mask=option)
    for name, g, r in zip(NAMES[1:], grads, reference[1:]):
        assert relative_error(g, r) < FP32_TOL, f"{dq_mode} {option} {name}: {relative_error(g, r):.2e}"
    for grad in grads[1:]:  # dK, dV of the keys dropped for every query
        assert not grad[0, :, 40:].any() and not grad[2, :, 129:].any()


def test_fully_padded_batch_gives_zeros():
    B, H, Lq, Lk, P = 2, 3, 37, 29, 16
    ref_inputs, kernel_inputs, do = make_inputs(B, H, Lq, Lk, P, torch.float32, seed=9)
    kpm = padding_mask(B, Lk)
    kpm[1] = True
    o = fused_attention(*kernel_inputs, scale=0.3, dropout_p=0.2, seed=3, key_padding_mask=kpm.to(DEVICE))
    o.backward(do.to(DEVICE, torch.float32))
    _, lse = attention_forward(*kernel_inputs, scale=0.3, key_padding_mask=kpm.to(DEVICE))
    assert torch.isinf(lse[1]).all() and torch.isfinite(lse[0]).all()
    for t in [o] + [t.grad for t in kernel_inputs]:
        assert torch.isfinite(t).all() and not t[1].any()
    ref = [t[:1].clone().requires_grad_() for t in ref_inputs]
    out = eager_attention(*ref, scale=0.3, dropout_p=0.0, seed=0, offset=0, key_padding_mask=kpm[:1])
    o_nodrop = fused_attention(*[t.detach() for t in kernel_inputs], scale=0.3, key_padding_mask=kpm.to(DEVICE))
    assert relative_error(o_nodrop[:1], out) < FP32_TOL


def test_rejects_bad_arguments():
    q = torch.randn(1, 1, 5, 24)
    with pytest.raises(ValueError, match="head dim"):
        attention_forward(q, q, q, scale=1.0)
    q = torch.randn(1, 1, 5, 16)
    with pytest.raises(ValueError, match="dropout_p"):
        attention_forward(q, q, q, scale=1.0, dropout_p=1.0)
    with pytest.raises(ValueError, match="rounds to 1"):
        attention_forward(q, q, q, scale=1.0, dropout_p=0.999)
    with pytest.raises(ValueError, match="key_padding_mask"):
        attention_forward(q, q, q, scale=1.0, key_padding_mask=torch.zeros(1, 4, dtype=torch.bool))
    q = torch.randn(1, 1, 64, 16)
    args = dict(scale=1.0, dropout_p=0.1)
    o, lse = attention_forward(q, q, q, **args)
    saved = new_saved_mask(q, q, dropout_p=0.1)
    assert saved.shape == (1, 1, 64, 4) and saved.dtype == torch.int16
    with pytest.raises(ValueError, match="block_k a multiple of 64"):
        attention_forward(q, q, q, **args, saved_mask=saved, block_k=32)
    with pytest.raises(ValueError, match="dropout_mask"):
        attention_backward(q, q, q, q, o, lse, **args, dropout_mask="saved")
    with pytest.raises(ValueError, match="dropout_mask"):
        attention_backward(q, q, q, q, o, lse, **args, saved_mask=saved, dropout_mask="regenerate")
    with pytest.raises(ValueError, match="dropout_mask"):
        attention_backward(q, q, q, q, o, lse, **args, dropout_mask="nibbles")


@pytest.mark.parametrize("KV", [2, 3])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dropout_p", [0.0, 0.2])
def test_gqa_matches_float64(KV, causal, dropout_p):
    """Grouped-query attention: 6 query heads over KV = 2 or 3 K/V heads (3 or 2 per group), K/V read
    in place of their repetition: O and dQ, dK, dV (dK, dV over the K/V heads, each its group's
    sum) against float64 with k and v repeated first, causal or not, with and without dropout (the
    mask over the query heads, regenerated), both dQ modes; q in (b, j, h, p), K/V in (b, h, j, p)."""
    B, H, Lq, Lk, P = 2, 6, 37, 37, 16
    ref_inputs, kernel_inputs, do = make_inputs(B, H, Lq, Lk, P, torch.float32, "bjhp", seed=30 + KV, KV=KV)
    kernel_inputs[1:] = [stored_as(t.detach(), "bhjp").requires_grad_() for t in kernel_inputs[1:]]
    for dq_mode in ("atomic", "split"):
        for t in kernel_inputs:
            t.grad = None
        got, reference, _ = run_both(ref_inputs, kernel_inputs, do, scale=0.3, dropout_p=dropout_p, seed=4321,
                                     offset=7, causal=causal, backward_config=dict(dq_mode=dq_mode))
        assert got[2].shape == (B, KV, Lk, P) and got[3].shape == (B, KV, Lk, P)
        for name, g, r in zip(NAMES, got, reference):
            assert g.shape == r.shape
            assert relative_error(g, r) < FP32_TOL, f"{dq_mode} {name}: {relative_error(g, r):.2e}"


@pytest.mark.parametrize("dq_mode,option", [("atomic", "regenerate"), ("split", "saved"), ("atomic", "saved")])
def test_gqa_padding_and_saved_mask(dq_mode, option):
    """Grouped-query attention with a key padding mask and dropout drawn one Philox call per sixteen
    keys (Lk = 64): the backward regenerating the mask or reading the one the forward saved over
    the query heads (bit for bit NumPy's), and ``groups`` given explicitly."""
    B, H, KV, Lq, Lk, P = 2, 4, 2, 23, 64, 16
    kpm = padding_mask(B, Lk, seed=3)
    args = dict(scale=0.3, dropout_p=0.3, seed=99, offset=64, key_padding_mask=kpm.to(DEVICE))
    ref_inputs, kernel_inputs, do = make_inputs(B, H, Lq, Lk, P, torch.float32, "bjhp", seed=41, KV=KV)
    got, reference, _ = run_both(ref_inputs, kernel_inputs, do, **args)
    for name, g, r in zip(NAMES, got, reference):
        assert relative_error(g, r) < FP32_TOL, f"{name}: {relative_error(g, r):.2e}"
    q, k, v = (t.detach() for t in kernel_inputs)
    saved = new_saved_mask(q, k, dropout_p=0.3, offset=64) if option == "saved" else None
    o, lse = attention_forward(q, k, v, **args, saved_mask=saved, groups=2)
    assert torch.equal(o, got[0].detach())
    if saved is not None:
        assert saved.shape == (B, H, Lq, Lk // 16)
        assert torch.equal(saved.cpu(), saved_bits(probability_keep(99, 64, 0.3, B, H, Lq, Lk)))
    grads = attention_backward(do.to(DEVICE, torch.float32), q, k, v, o, lse, **args, saved_mask=saved, groups=2,
                               dq_mode=dq_mode, dropout_mask=option)
    for name, g, r in zip(NAMES[1:], grads, reference[1:]):
        assert relative_error(g, r) < FP32_TOL, f"{dq_mode} {option} {name}: {relative_error(g, r):.2e}"


def test_gqa_low_precision_acceptance():
    """bf16, 8 query heads over 2 K/V heads, causal, dropout: no farther from float64 than PyTorch's
    eager chain at bf16 repeating K/V (``harness.accuracy``)."""
    B, H, KV, L, P = 2, 8, 2, 29, 32
    ref_inputs, kernel_inputs, do = make_inputs(B, H, L, L, P, torch.bfloat16, "bhjp", seed=42, KV=KV)
    got, reference, baseline = run_both(ref_inputs, kernel_inputs, do, baseline_dtype=torch.bfloat16, scale=P**-0.5,
                                        dropout_p=0.1, seed=5, offset=3, causal=True)
    for name, g, r, base in zip(NAMES, got, reference, baseline):
        assert g.dtype == torch.bfloat16
        assert_closer(g, base, r, what=name)


def test_gqa_default_backward_splits_dq_on_a_gpu():
    """With grouped K/V heads the GPU default backward computes dQ in its own kernel (measured faster
    at Llama-3.2-1B's attention); without groups the defaults are as they were."""
    for P in (64, 128):
        plain = default_config(P, "backward", interpret=False)
        assert default_config(P, "backward", interpret=False, groups=1) == plain
        assert default_config(P, "backward", interpret=False, groups=4) == dict(plain, dq_mode="split")
    assert default_config(64, "backward", interpret=False)["dq_mode"] == "atomic"


def test_gqa_rejects_bad_arguments():
    q, k = torch.randn(1, 6, 5, 16), torch.randn(1, 4, 5, 16)
    with pytest.raises(ValueError, match="whole number of groups"):
        attention_forward(q, k, k, scale=1.0)
    k = torch.randn(1, 2, 5, 16)
    with pytest.raises(ValueError, match="groups=2: q has 6 heads and k, v 2, so 3"):
        attention_forward(q, k, k, scale=1.0, groups=2)
    with pytest.raises(ValueError, match="whole number of groups"):
        attention_forward(q, k, torch.randn(1, 3, 5, 16), scale=1.0)
    bias = torch.zeros(6, 16)
    with pytest.raises(ValueError, match="not taken with grouped K/V heads"):
        attention_forward(q, k, k, scale=1.0, bias=(bias, bias), q_biased=torch.empty_like(q))


@pytest.mark.gpu
@pytest.mark.parametrize("H,P,causal,backward", [
    (16, 64, False, dict(block_j=64, block_k=64, num_warps=4, num_stages=3, dq_mode="atomic")),
    (16, 64, True, dict(block_j=64, block_k=64, num_warps=4, num_stages=3, dq_mode="split")),
    (16, 64, False, dict(block_j=64, block_k=128, num_warps=8, num_stages=3, dq_mode="split")),
    (8, 128, False, dict(block_j=64, block_k=128, num_warps=8, num_stages=3, dq_mode="atomic")),
    (8, 128, False, dict(block_j=64, block_k=64, num_warps=4, num_stages=2, dq_mode="split"))])
@pytest.mark.parametrize("dropout_mask", DROPOUT_MASK_OPTIONS)
def test_bert_large_gpu(H, P, causal, backward, dropout_mask):
    """BERT-large sizes, bf16, dropout 0.1, BERT's (b, j, h, p) storage = the [B, L, H*P] view,
    through ``fused_attention`` with the backward regenerating the mask or reading the one the
    forward saved (bit for bit NumPy's)."""
    B, L = 8, 512
    backward = dict(backward, dropout_mask=dropout_mask)
    assert backward in attention_configs(P, "backward")
    ref_inputs, kernel_inputs, do = make_inputs(B, H, L, L, P, torch.bfloat16, "bjhp", seed=10)
    args = dict(scale=P**-0.5, dropout_p=0.1, seed=0x5EED, offset=0, causal=causal)
    got, reference, baseline = run_both(ref_inputs, kernel_inputs, do, baseline_dtype=torch.bfloat16, **args,
                                        backward_config=backward)
    for name, g, r, base in zip(NAMES, got, reference, baseline):
        assert_closer(g, base, r, what=name)
    if dropout_mask == "saved" and not causal:
        q, k = (t.detach() for t in kernel_inputs[:2])
        saved = new_saved_mask(q, k, dropout_p=0.1)
        attention_forward(q, k, k, **args, saved_mask=saved)
        assert torch.equal(saved.cpu(), saved_bits(probability_keep(0x5EED, 0, 0.1, B, H, L, L)))



@pytest.mark.gpu
@pytest.mark.parametrize("backward", [dict(block_j=64, block_k=64, num_warps=4, num_stages=3, dq_mode="atomic"),
                                      dict(block_j=64, block_k=128, num_warps=8, num_stages=3, dq_mode="split")])
@pytest.mark.parametrize("dropout_mask", DROPOUT_MASK_OPTIONS)
def test_bert_large_padded_tails_gpu(backward, dropout_mask):
    """BERT-large sizes, bf16, dropout 0.1, padded tails as ``benchmarks/model.py``'s (one sequence
    unpadded, one ending right after a block's first key): the key blocks after each sequence's
    last kept key are skipped, and O and every gradient stay as close to float64 as PyTorch's bf16
    chain; the dropped keys' dK and dV exactly zero."""
    B, H, L, P = 8, 16, 512, 64
    backward = dict(backward, dropout_mask=dropout_mask)
    kept = torch.tensor([367, 503, 280, 512, 129, 327, 292, 65])
    kpm = torch.arange(L)[None, :] >= kept[:, None]
    ref_inputs, kernel_inputs, do = make_inputs(B, H, L, L, P, torch.bfloat16, "bjhp", seed=11)
    args = dict(scale=P**-0.5, dropout_p=0.1, seed=0x5EED, offset=0)
    got, reference, baseline = run_both(ref_inputs, kernel_inputs, do, baseline_dtype=torch.bfloat16, **args,
                                        key_padding_mask=kpm.to(DEVICE), backward_config=backward)
    for name, g, r, base in zip(NAMES, got, reference, baseline):
        assert_closer(g, base, r, what=name)
    for grad in got[2:]:  # (b, h, k, p), stored (b, k, h, p)
        assert all(not grad[b, :, n:].any() for b, n in enumerate(kept.tolist()))


@pytest.mark.gpu
@pytest.mark.parametrize("H,KV,P,L,backward", [
    (32, 8, 64, 2048, dict(block_j=64, block_k=64, num_warps=4, num_stages=3, dq_mode="atomic")),
    (32, 8, 64, 2048, dict(block_j=64, block_k=128, num_warps=8, num_stages=3, dq_mode="split")),
    (32, 8, 128, 1024, dict(block_j=64, block_k=64, num_warps=4, num_stages=2, dq_mode="split")),
    (32, 8, 128, 1024, dict(block_j=64, block_k=128, num_warps=8, num_stages=3, dq_mode="atomic"))])
@pytest.mark.parametrize("dropout_p", [0.0, 0.1])
def test_gqa_llama_gpu(H, KV, P, L, backward, dropout_p):
    """Llama sizes, bf16, causal: Llama-3.2-1B's attention (32 query heads over 8 K/V heads, head
    dim 64, T=2048) and Llama-3-8B's (head dim 128), Q in HF's (b, j, h, p) projection layout, K
    and V read in place over the K/V heads: O and every gradient as close to float64 as PyTorch's
    bf16 chain repeating K/V first, with dropout 0 and 0.1 (the mask regenerated)."""
    B = 2
    backward = dict(backward, dropout_mask="regenerate")
    assert backward in attention_configs(P, "backward")
    ref_inputs, kernel_inputs, do = make_inputs(B, H, L, L, P, torch.bfloat16, "bjhp", seed=13, KV=KV)
    args = dict(scale=P**-0.5, dropout_p=dropout_p, seed=0x5EED, offset=0, causal=True)
    got, reference, baseline = run_both(ref_inputs, kernel_inputs, do, baseline_dtype=torch.bfloat16, **args,
                                        backward_config=backward)
    assert got[2].shape == (B, KV, L, P)
    for name, g, r, base in zip(NAMES, got, reference, baseline):
        assert_closer(g, base, r, what=name)


@pytest.mark.parametrize("has_bias,groups", [(False, 1), (True, 1), (False, 4)])
@pytest.mark.parametrize("block_k,grouped,mask_io", [(64, True, 1), (128, False, 0)])
def test_kernels_compile_for_hopper(has_bias, groups, block_k, grouped, mask_io):
    """Every attention kernel goes through Triton's compiler to sm_90 PTX (``compile_attention.py``,
    in a process without the interpreter, which runs the kernels as Python and misses what only the
    compiler checks: the first kernels with biases ran here and failed to compile on the H200, a
    shape mismatch after a ``return`` in a constexpr branch under Triton 3.6)."""
    import os
    import subprocess
    import sys

    import triton

    if "nvidia" not in triton.backends.backends:
        pytest.skip("this Triton has no CUDA backend")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    flags = dict(BLOCK_K=block_k, GROUPED=grouped, MASK_IO=mask_io, HAS_BIAS=has_bias, GROUPS=groups)
    done = subprocess.run([sys.executable, str(Path(__file__).with_name("compile_attention.py")), json.dumps(flags)],
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["_attn_fwd_kernel", "_attn_bwd_preprocess_kernel", "_attn_bwd_dkdv_kernel",
                                   "_attn_bwd_dq_kernel"]
