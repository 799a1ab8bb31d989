"""The NumPy Philox and the dropout convention are reproduced bit for bit by the Triton helpers
(through the interpreter on CPU, natively on a GPU)."""
import numpy as np
import pytest
import torch
import triton
import triton.language as tl

from dataflow.dropout_mask import decision_values, keep_mask, keep_threshold, philox_uniform, philox_words
from kernels.philox import dropout_keep, dropout_keep_octets, keep_halves


def _device():
    return "cuda" if torch.cuda.is_available() else "cpu"


@triton.jit
def _rand_kernel(out_ptr, words_ptr, keep_ptr, halves_ptr, n, seed, offset, threshold, BLOCK: tl.constexpr):
    idx = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inside = idx < n
    tl.store(out_ptr + idx, tl.rand(seed, offset + idx), mask=inside)
    w0, w1, w2, w3 = tl.randint4x(seed, offset + idx)
    tl.store(words_ptr + 4 * idx, w0.to(tl.int32, bitcast=True), mask=inside)
    tl.store(words_ptr + 4 * idx + 1, w1.to(tl.int32, bitcast=True), mask=inside)
    tl.store(words_ptr + 4 * idx + 2, w2.to(tl.int32, bitcast=True), mask=inside)
    tl.store(words_ptr + 4 * idx + 3, w3.to(tl.int32, bitcast=True), mask=inside)
    tl.store(keep_ptr + idx, dropout_keep(seed, offset, idx, threshold).to(tl.int8), mask=inside)
    low, high = keep_halves(w1, threshold)
    tl.store(halves_ptr + 2 * idx, low.to(tl.int8), mask=inside)
    tl.store(halves_ptr + 2 * idx + 1, high.to(tl.int8), mask=inside)


def test_philox_matches_triton_rand_and_convention():
    n, seed, offset, p = 1237, 0x1234_5678_9ABC, 977, 0.1
    out = torch.empty(n, dtype=torch.float32, device=_device())
    words = torch.empty(n, 4, dtype=torch.int32, device=_device())
    keep = torch.empty(n, dtype=torch.int8, device=_device())
    halves = torch.empty(n, 2, dtype=torch.int8, device=_device())
    _rand_kernel[(triton.cdiv(n, 256),)](out, words, keep, halves, n, seed, offset, keep_threshold(p), BLOCK=256)
    counters = offset + np.arange(n)
    np.testing.assert_array_equal(out.cpu().numpy(), philox_uniform(seed, counters))
    expected_words = philox_words(seed, counters)
    np.testing.assert_array_equal(words.cpu().numpy().view(np.uint32), expected_words)
    expected = keep_mask(seed, offset, (n,), p)
    np.testing.assert_array_equal(keep.cpu().numpy().astype(bool), expected)
    w1 = expected_words[:, 1]
    np.testing.assert_array_equal(halves.cpu().numpy().astype(bool),
                                  np.stack([(w1 & 0xFFFF) >= keep_threshold(p), (w1 >> 16) >= keep_threshold(p)], axis=1))
    assert 0.85 < expected.mean() < 0.95


def test_convention_groups_of_64_counters():
    """Counter g = 64 G + 8 h + c takes half h of the call on counter 8 G + c (low half of word w =
    half 2w); kept iff that value >= round(p * 65536); the offset shifts the counters."""
    seed, offset = 77, 6
    values = decision_values(seed, offset, (3, 70))
    g = offset + np.arange(210)
    calls, halves = (g // 64) * 8 + g % 8, (g // 8) % 8
    words = philox_words(seed, calls)[np.arange(210), halves // 2]
    np.testing.assert_array_equal(values.ravel(), np.where(halves % 2 == 0, words & 0xFFFF, words >> 16))
    assert len(np.unique(values)) > 200  # 16-bit values: a few birthday collisions
    assert (calls[8:16] == calls[:8]).all() and calls[64 - offset] == 8  # a group's columns c, c + 8, ... share call c
    assert keep_threshold(0.1) == 6554 and keep_threshold(0.0) == 0
    np.testing.assert_array_equal(keep_mask(seed, offset, (3, 70), 0.3), values >= 19661)
    assert keep_mask(seed, offset, (3, 70), 0.0).all()
    with pytest.raises(ValueError, match="not in"):
        keep_threshold(1.0)


def test_drop_rate_is_p_to_within_one_level():
    kept = keep_mask(3, 0, (400_000,), 0.1).mean()
    assert abs((1 - kept) - 0.1) < 4 * (0.1 * 0.9 / 400_000) ** 0.5 + 1 / 65536


@triton.jit
def _octets_kernel(keep_ptr, rows, cols, seed, offset, threshold, BLOCK_R: tl.constexpr, BLOCK_Q: tl.constexpr):
    """keep[r, c] of a (rows, cols) mask, cols % 64 == 0, from one call per eight columns."""
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    q = tl.program_id(1) * BLOCK_Q + tl.arange(0, BLOCK_Q)
    keep = dropout_keep_octets(seed, (offset + r[:, None] * cols + 8 * q[None, :]) >> 3, threshold)
    c = tl.program_id(1) * 8 * BLOCK_Q + tl.arange(0, 8 * BLOCK_Q)
    tl.store(keep_ptr + r[:, None] * cols + c[None, :], keep.to(tl.int8), mask=(r[:, None] < rows) & (c[None, :] < cols))


def test_octets_match_convention():
    rows, cols, seed, offset, p = 37, 192, 0xABCDEF, 1024 + 64, 0.3
    keep = torch.empty(rows, cols, dtype=torch.int8, device=_device())
    _octets_kernel[(triton.cdiv(rows, 16), triton.cdiv(cols, 128))](keep, rows, cols, seed, offset, keep_threshold(p),
                                                                     BLOCK_R=16, BLOCK_Q=16)
    np.testing.assert_array_equal(keep.cpu().numpy().astype(bool), keep_mask(seed, offset, (rows, cols), p))


@triton.jit
def _keep_kernel(keep_ptr, n, seed, offset, threshold, BLOCK: tl.constexpr):
    idx = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(keep_ptr + idx, dropout_keep(seed, offset, idx, threshold).to(tl.int8), mask=idx < n)


@pytest.mark.parametrize("seed,offset,p", [(0x5EED, 0, 0.1), (1, 1, 0.25), (2**40 + 3, 977, 0.5), (7, 2**35 + 5, 0.9),
                                           (2**63 - 1, 123, 1e-3)])
def test_keep_extreme_seeds_and_offsets(seed, offset, p):
    """64-bit seeds and call counters past 2**32 (the counter's high word) decide as in NumPy."""
    n = 3001
    keep = torch.empty(n, dtype=torch.int8, device=_device())
    _keep_kernel[(triton.cdiv(n, 1024),)](keep, n, seed, offset, keep_threshold(p), BLOCK=1024)
    np.testing.assert_array_equal(keep.cpu().numpy().astype(bool), keep_mask(seed, offset, (n,), p))
