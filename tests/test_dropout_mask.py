"""The NumPy Philox and the dropout convention are reproduced bit for bit by the Triton helpers
(through the interpreter on CPU, natively on a GPU)."""
import numpy as np
import pytest
import torch
import triton
import triton.language as tl

from datamove.dataflow.dropout_mask import (decision_values, dropout_scale, dropout_scale_mask, keep_mask, keep_threshold,
                                   philox_uniform, philox_words)
from datamove.kernels.philox import dropout_keep, dropout_keep_grouped, keep_bits, unpack_rows


def _device():
    return "cuda" if torch.cuda.is_available() else "cpu"


@triton.jit
def _rand_kernel(out_ptr, words_ptr, keep_ptr, bits_ptr, n, seed, offset, threshold, BLOCK: tl.constexpr):
    idx = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inside = idx < n
    tl.store(out_ptr + idx, tl.rand(seed, offset + idx), mask=inside)
    w0, w1, w2, w3 = tl.randint4x(seed, offset + idx)
    tl.store(words_ptr + 4 * idx, w0.to(tl.int32, bitcast=True), mask=inside)
    tl.store(words_ptr + 4 * idx + 1, w1.to(tl.int32, bitcast=True), mask=inside)
    tl.store(words_ptr + 4 * idx + 2, w2.to(tl.int32, bitcast=True), mask=inside)
    tl.store(words_ptr + 4 * idx + 3, w3.to(tl.int32, bitcast=True), mask=inside)
    tl.store(keep_ptr + idx, dropout_keep(seed, offset, idx, threshold).to(tl.int8), mask=inside)
    tl.store(bits_ptr + idx, keep_bits(seed, offset + idx, threshold).to(tl.int16, bitcast=True), mask=inside)


def _call_bytes(words: np.ndarray) -> np.ndarray:
    """[n, 4] uint32 Philox words -> [n, 16] uint8: byte 4 w + k is bits 8 k .. 8 k + 7 of word w."""
    return ((words[:, :, None] >> (8 * np.arange(4, dtype=np.uint32))) & 0xFF).reshape(len(words), 16).astype(np.uint8)


def test_philox_matches_triton_rand_and_convention():
    n, seed, offset, p = 1237, 0x1234_5678_9ABC, 977, 0.1
    out = torch.empty(n, dtype=torch.float32, device=_device())
    words = torch.empty(n, 4, dtype=torch.int32, device=_device())
    keep = torch.empty(n, dtype=torch.int8, device=_device())
    bits = torch.empty(n, dtype=torch.int16, device=_device())
    _rand_kernel[(triton.cdiv(n, 256),)](out, words, keep, bits, n, seed, offset, keep_threshold(p), BLOCK=256)
    counters = offset + np.arange(n)
    np.testing.assert_array_equal(out.cpu().numpy(), philox_uniform(seed, counters))
    expected_words = philox_words(seed, counters)
    np.testing.assert_array_equal(words.cpu().numpy().view(np.uint32), expected_words)
    expected = keep_mask(seed, offset, (n,), p)
    np.testing.assert_array_equal(keep.cpu().numpy().astype(bool), expected)
    bit_of_byte = (bits.cpu().numpy().view(np.uint16)[:, None] >> np.arange(16, dtype=np.uint16)) & 1
    np.testing.assert_array_equal(bit_of_byte.astype(bool), _call_bytes(expected_words) >= keep_threshold(p))
    assert 0.85 < expected.mean() < 0.95


def test_convention_groups_of_64_counters():
    """Counter g = 64 G + 8 i + 2 t + e takes byte 2 i + e of the call on counter 4 G + t (byte 4 w + k
    = bits 8 k.. of word w); kept iff that byte >= round(p * 256); the offset shifts the counters."""
    seed, offset = 77, 6
    values = decision_values(seed, offset, (3, 70))
    g = offset + np.arange(210)
    calls, byte = (g // 64) * 4 + (g % 8) // 2, 2 * ((g // 8) % 8) + g % 2
    np.testing.assert_array_equal(values.ravel(), _call_bytes(philox_words(seed, calls))[np.arange(210), byte])
    assert values.dtype == np.uint8 and len(np.unique(values)) > 120  # 210 draws of 256 levels: ~143 distinct
    n_of = lambda counter: counter - offset  # noqa: E731
    assert (calls[[n_of(x) for x in (66, 67, 74, 75, 122, 123)]] == 5).all()  # call 4 G + t: pairs 2 t, 2 t + 1 of every 8
    assert len(set(calls[n_of(64):n_of(128)])) == 4 and calls[n_of(128)] == 8
    assert keep_threshold(0.1) == 26 and keep_threshold(0.0) == 0 and keep_threshold(1e-3) == 0
    assert dropout_scale(0.1) == 256 / 230 and dropout_scale(0.0) == 1.0
    np.testing.assert_array_equal(keep_mask(seed, offset, (3, 70), 0.3), values >= 77)
    assert keep_mask(seed, offset, (3, 70), 0.0).all()
    with pytest.raises(ValueError, match="not in"):
        keep_threshold(1.0)
    with pytest.raises(ValueError, match="rounds to 1"):
        keep_threshold(0.999)


def test_drop_rate_is_p_rounded_and_expectation_exact():
    """Dropped with probability round(p * 256) / 256; the kept scale makes the mean multiplier 1."""
    n, p = 400_000, 0.1
    sigma = (0.1 * 0.9 / n) ** 0.5
    assert abs((1 - keep_mask(3, 0, (n,), p).mean()) - 26 / 256) < 4 * sigma
    assert abs(dropout_scale_mask(3, 0, (n,), p).mean() - 1.0) < 4 * sigma * dropout_scale(p)


@triton.jit
def _grouped_kernel(keep_ptr, rows, cols, seed, offset, threshold, BLOCK_R: tl.constexpr, BLOCK_Q: tl.constexpr):
    """keep[r, c] of a (rows, cols) mask, cols % 64 == 0, from one call per sixteen columns."""
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    q = tl.program_id(1) * BLOCK_Q + tl.arange(0, BLOCK_Q)
    keep = dropout_keep_grouped(seed, (offset + r[:, None] * cols + 16 * q[None, :]) >> 4, threshold)
    c = tl.program_id(1) * 16 * BLOCK_Q + tl.arange(0, 16 * BLOCK_Q)
    tl.store(keep_ptr + r[:, None] * cols + c[None, :], keep.to(tl.int8), mask=(r[:, None] < rows) & (c[None, :] < cols))


def test_grouped_match_convention():
    rows, cols, seed, offset, p = 37, 192, 0xABCDEF, 1024 + 64, 0.3
    keep = torch.empty(rows, cols, dtype=torch.int8, device=_device())
    _grouped_kernel[(triton.cdiv(rows, 16), triton.cdiv(cols, 128))](keep, rows, cols, seed, offset, keep_threshold(p),
                                                                      BLOCK_R=16, BLOCK_Q=8)
    np.testing.assert_array_equal(keep.cpu().numpy().astype(bool), keep_mask(seed, offset, (rows, cols), p))


@triton.jit
def _row_calls_kernel(keep_ptr, rows, cols, seed, offset, threshold, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """keep[r, c] of a (rows, cols) mask whose rows run along the counters (counter offset + c * rows + r,
    rows % 64 == 0): program pid takes BLOCK_R rows of call 4 G + t of every column, the rows
    64 G + 2 t + 8 i + e for BLOCK_R // 2 consecutive i (as ``kernels.codegen`` numbers them)."""
    pid = tl.program_id(0)
    b = tl.arange(0, BLOCK_R)
    first = ((pid // 4) % (16 // BLOCK_R)) * BLOCK_R
    r = (pid // (64 // BLOCK_R)) * 64 + 2 * (pid % 4) + 4 * first + 8 * (b // 2) + b % 2
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    calls = ((offset + c * rows + (pid // (64 // BLOCK_R)) * 64) >> 4) + pid % 4
    keep = unpack_rows(keep_bits(seed, calls[None, :], threshold), first, BLOCK_R)
    tl.store(keep_ptr + r[:, None] * cols + c[None, :], keep.to(tl.int8), mask=c[None, :] < cols)


@pytest.mark.parametrize("block_rows", [2, 4, 8, 16])
def test_row_calls_match_convention(block_rows):
    rows, cols, seed, offset, p = 128, 37, 0xFACE, 640, 0.2
    keep = torch.full((rows, cols), -1, dtype=torch.int8, device=_device())
    _row_calls_kernel[(rows // block_rows, triton.cdiv(cols, 32))](keep, rows, cols, seed, offset, keep_threshold(p),
                                                                   BLOCK_R=block_rows, BLOCK_C=32)
    np.testing.assert_array_equal(keep.cpu().numpy(), keep_mask(seed, offset, (cols, rows), p).T.astype(np.int8))


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
