"""The NumPy Philox and the dropout convention are reproduced bit for bit by the Triton helpers
(through the interpreter on CPU, natively on a GPU)."""
import numpy as np
import pytest
import torch
import triton
import triton.language as tl

from dataflow.dropout_mask import dropout_uniform, keep_mask, philox_uniform, philox_words
from kernels.philox import dropout_keep, dropout_keep_quads, keep_threshold


def _device():
    return "cuda" if torch.cuda.is_available() else "cpu"


@triton.jit
def _rand_kernel(out_ptr, words_ptr, keep_ptr, n, seed, offset, threshold, BLOCK: tl.constexpr):
    idx = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inside = idx < n
    tl.store(out_ptr + idx, tl.rand(seed, offset + idx), mask=inside)
    w0, w1, w2, w3 = tl.randint4x(seed, offset + idx)
    tl.store(words_ptr + 4 * idx, w0.to(tl.int32, bitcast=True), mask=inside)
    tl.store(words_ptr + 4 * idx + 1, w1.to(tl.int32, bitcast=True), mask=inside)
    tl.store(words_ptr + 4 * idx + 2, w2.to(tl.int32, bitcast=True), mask=inside)
    tl.store(words_ptr + 4 * idx + 3, w3.to(tl.int32, bitcast=True), mask=inside)
    tl.store(keep_ptr + idx, dropout_keep(seed, offset, idx, threshold).to(tl.int8), mask=inside)


def test_philox_matches_triton_rand_and_convention():
    n, seed, offset, p = 1237, 0x1234_5678_9ABC, 977, 0.1
    out = torch.empty(n, dtype=torch.float32, device=_device())
    words = torch.empty(n, 4, dtype=torch.int32, device=_device())
    keep = torch.empty(n, dtype=torch.int8, device=_device())
    _rand_kernel[(triton.cdiv(n, 256),)](out, words, keep, n, seed, offset, keep_threshold(p), BLOCK=256)
    counters = offset + np.arange(n)
    np.testing.assert_array_equal(out.cpu().numpy(), philox_uniform(seed, counters))
    np.testing.assert_array_equal(words.cpu().numpy().view(np.uint32), philox_words(seed, counters))
    expected = keep_mask(seed, offset, (n,), p)
    np.testing.assert_array_equal(keep.cpu().numpy().astype(bool), expected)
    assert 0.85 < expected.mean() < 0.95


def test_convention_four_elements_per_call():
    """Element g takes word g % 4 of the call on counter g // 4; the offset shifts the counters."""
    seed, offset = 77, 6
    u = dropout_uniform(seed, offset, (3, 5))
    g = offset + np.arange(15)
    words = philox_words(seed, g // 4)[np.arange(15), g % 4]
    np.testing.assert_array_equal(u.ravel(), ((words.view(np.int32) ^ (words.view(np.int32) >> 31))
                                              .astype(np.float32) * np.float32(4.6566127342e-10)))
    assert len(np.unique(u)) == 15


@pytest.mark.parametrize("p", [0.0, 0.1, 0.5, 0.9])
def test_threshold_is_the_float_comparison(p):
    x = np.random.default_rng(1).integers(-2**31, 2**31, 200_000).astype(np.int64)
    x = np.concatenate([x, [keep_threshold(p) - 1, keep_threshold(p), keep_threshold(p) + 1]])
    mag = np.where(x < 0, ~x, x)
    assert np.array_equal(mag.astype(np.float32) * np.float32(4.6566127342e-10) > np.float32(p),
                          mag > keep_threshold(p))


@triton.jit
def _quads_kernel(keep_ptr, rows, cols, seed, offset, threshold, BLOCK_R: tl.constexpr, BLOCK_Q: tl.constexpr):
    """keep[r, c] of a (rows, cols) mask, cols % 4 == 0, from one call per four columns."""
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    q = tl.program_id(1) * BLOCK_Q + tl.arange(0, BLOCK_Q)
    keep = dropout_keep_quads(seed, (offset + r[:, None] * cols + 4 * q[None, :]) >> 2, threshold)
    c = tl.program_id(1) * 4 * BLOCK_Q + tl.arange(0, 4 * BLOCK_Q)
    tl.store(keep_ptr + r[:, None] * cols + c[None, :], keep.to(tl.int8), mask=(r[:, None] < rows) & (c[None, :] < cols))


def test_quads_match_convention():
    rows, cols, seed, offset, p = 37, 52, 0xABCDEF, 1024 + 8, 0.3
    keep = torch.empty(rows, cols, dtype=torch.int8, device=_device())
    _quads_kernel[(triton.cdiv(rows, 16), triton.cdiv(cols, 32))](keep, rows, cols, seed, offset, keep_threshold(p),
                                                                   BLOCK_R=16, BLOCK_Q=8)
    np.testing.assert_array_equal(keep.cpu().numpy().astype(bool), keep_mask(seed, offset, (rows, cols), p))


@triton.jit
def _keep_kernel(keep_ptr, n, seed, offset, threshold, BLOCK: tl.constexpr):
    idx = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(keep_ptr + idx, dropout_keep(seed, offset, idx, threshold).to(tl.int8), mask=idx < n)


@pytest.mark.parametrize("seed,offset,p", [(0x5EED, 0, 0.1), (1, 1, 0.25), (2**40 + 3, 977, 0.5), (7, 2**33 + 5, 0.9),
                                           (2**63 - 1, 123, 1e-3)])
def test_keep_extreme_seeds_and_offsets(seed, offset, p):
    """64-bit seeds and counters past 2**32 (the counter's high word) decide as in NumPy."""
    n = 3001
    keep = torch.empty(n, dtype=torch.int8, device=_device())
    _keep_kernel[(triton.cdiv(n, 1024),)](keep, n, seed, offset, keep_threshold(p), BLOCK=1024)
    np.testing.assert_array_equal(keep.cpu().numpy().astype(bool), keep_mask(seed, offset, (n,), p))
