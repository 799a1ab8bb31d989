"""Layout changes (kernels.layout_change): the tiled permute copy in every storage order pair, exactly.

Through the Triton interpreter at odd sizes (tiles of 64 cover them partly: masked edges); the
same at BERT-large sizes on a GPU.
"""
import itertools

import pytest
import torch

from datamove.kernels.contraction import empty_in_layout
from datamove.harness.layout_change_variants import LayoutChangeVariant
from datamove.kernels.layout_change import permute_copy

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _pair(letters: str, sizes: dict, source: str, target: str, dtype=torch.float32, device=DEVICE):
    src = empty_in_layout(letters, source, sizes, dtype, device)
    src.copy_(torch.randn(src.shape, dtype=torch.float32) + 0.5)
    dst = empty_in_layout(letters, target, sizes, dtype, device)
    dst.fill_(float("nan"))
    return src, dst


@pytest.mark.parametrize("source,target", list(itertools.permutations(["ibj", "bji", "jbi", "ijb"], 2)))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_three_letters_every_pair(source, target, dtype):
    src, dst = _pair("ibj", dict(i=67, b=3, j=5), source, target, dtype)
    permute_copy(src, dst, block_s=16, block_a=32)
    assert torch.equal(dst, src)


@pytest.mark.parametrize("target", ["pbkh", "kbph", "bpkh", "hkbp"])
def test_four_letters(target):
    src, dst = _pair("phbk", dict(p=5, h=3, b=2, k=19), "phbk", target)
    permute_copy(src, dst, block_s=16, block_a=16)
    assert torch.equal(dst, src)


def test_two_letters_and_one():
    src, dst = _pair("bj", dict(b=3, j=70), "bj", "jb")
    permute_copy(src, dst)
    assert torch.equal(dst, src)
    src, dst = _pair("i", dict(i=77), "i", "i")
    permute_copy(src, dst, block_a=16)
    assert torch.equal(dst, src)


@pytest.mark.parametrize("source,target", [("kesb", "sbke"), ("fsb", "sbf"), ("sbf", "fsb")])
def test_a_dim_of_size_one_is_never_a_tile_dim(source, target):
    """Llama-8B at B=1: the batch, innermost in one order, takes no tile (1-wide tiles were 20x a
    copy's time on an H200); the copy is exact."""
    from datamove.kernels.layout_change import tile_dims

    letters = "".join(sorted(source))
    src, dst = _pair(letters, dict(k=3, e=40, s=37, b=1, f=33), source, target)
    s, a, _ = tile_dims(src, dst)
    assert src.shape[a] > 1 and src.shape[s] > 1
    innermost = lambda order: order.replace("b", "")[-1]  # noqa: E731
    assert a == letters.index(innermost(target)) and s == letters.index(innermost(source))
    permute_copy(src, dst, block_s=16, block_a=16)
    assert torch.equal(dst, src)


def test_refused():
    src, dst = _pair("ibj", dict(i=3, b=2, j=5), "ibj", "bji")
    with pytest.raises(ValueError, match="differ"):
        permute_copy(src, dst.to(torch.float64))
    big = torch.zeros([2] * 7)
    with pytest.raises(ValueError, match="at most 6"):
        permute_copy(big, big.clone())


def test_variant_checks_and_keys():
    variant = LayoutChangeVariant("ibj", dict(i=33, b=2, j=5), "bji", "ibj", torch.float32, DEVICE)
    variant.build()
    assert variant.check().passed
    assert variant.op == "layout:ibj" and variant.layout == {"from": "bji", "to": "ibj"}
    assert variant.knobs["impl"] == "triton-tiles" and variant.bytes == 2 * 33 * 2 * 5 * 4


@pytest.mark.gpu
@pytest.mark.parametrize("source,target", [("bji", "ibj"), ("ibj", "bji"), ("bji", "jib")])
def test_bert_large_gpu(source, target):
    src, dst = _pair("ibj", dict(i=1024, b=8, j=512), source, target, torch.bfloat16)
    permute_copy(src, dst)
    assert torch.equal(dst, src)
