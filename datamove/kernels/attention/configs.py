"""The fused attention's knobs (``kernels.attention``'s module doc): the valid configurations of
its kernels on this device, the defaults, the head dims taken."""
import torch
import triton

from datamove.dataflow.dropout_mask import DECISION_GROUP
from datamove.kernels.interpreter import interpreted

DROPOUT_MASK_OPTIONS = ("regenerate", "saved")  # how the backward gets the dropout mask (module doc)


def supported_head_dim(head_dim: int) -> bool:
    """Whether the kernels take heads of ``head_dim`` features: a power of two in [16, 256]."""
    return 16 <= head_dim <= 256 and not head_dim & (head_dim - 1)


def _check_head_dim(head_dim: int) -> None:
    if not supported_head_dim(head_dim):
        raise ValueError(f"head dim {head_dim} unsupported: must be a power of two in [16, 256]")


def _max_shared_memory() -> int:
    device = torch.cuda.current_device()
    return triton.runtime.driver.active.utils.get_device_properties(device)["max_shared_mem"]


def attention_configs(head_dim: int, direction: str, *, interpret: bool | None = None) -> list[dict]:
    """Valid knob configurations of the ``direction`` ("forward" or "backward") kernels.

    Each is a dict of ``block_j``, ``block_k`` (rows of the j / k tiles), ``num_warps``,
    ``num_stages`` and, for "backward", ``dq_mode`` ("atomic": one kernel over k-blocks that also
    adds dQ with fp32 atomics; "split": a second kernel over j-blocks computes dQ) and
    ``dropout_mask`` (``DROPOUT_MASK_OPTIONS``: "regenerate" or "saved", see the module doc). On a GPU the
    list keeps tiles whose pipelined operand buffers fit the device's shared memory and whose fp32
    tiles fit the registers (per thread: at most 64 score-tile elements, at most 64 forward / 128
    backward accumulator elements; beyond them ptxas spills), with 4 or 8 warps for 64-row tiles
    (8: each thread holds half as much of the tiles, e.g. the Philox state) and 8 for 128-row ones; in the Triton interpreter (no GPU) warps and stages
    mean nothing and the list holds small tiles.
    """
    _check_head_dim(head_dim)
    if direction not in ("forward", "backward"):
        raise ValueError(f"direction must be 'forward' or 'backward', not {direction!r}")
    interpret = interpreted() if interpret is None else interpret
    dq_modes = ("atomic", "split") if direction == "backward" else (None,)
    if interpret:
        tiles = [(bj, bk, 4, 1, mode) for bj in (16, 32, 64) for bk in (16, 32, 64) for mode in dq_modes]
    else:
        smem = _max_shared_memory()
        tiles = []
        for bj, bk in ((64, 32), (64, 64), (64, 128), (128, 32), (128, 64), (128, 128)) if direction == "forward" else \
                ((32, 32), (32, 64), (64, 64), (32, 128), (64, 128)):
            rows = bj if direction == "forward" else bk
            for warps, stages, mode in [(w, s, m) for w in ((4, 8) if rows <= 64 else (8,)) for s in (2, 3)
                                        for m in dq_modes]:
                threads = 32 * warps
                if direction == "forward":
                    buffers = 2 * (bj * head_dim + stages * 2 * bk * head_dim + bj * bk)  # Q, staged K, V, P~
                    fits = bj * bk // threads <= 64 and bj * head_dim // threads <= 64  # S tile, O accumulator
                else:
                    buffers = 2 * (2 * bk * head_dim + stages * 2 * bj * head_dim + bj * bk)  # K, V, staged Q, dO, dS
                    if mode == "split":  # the dQ kernel: Q, dO, staged K, V, dS
                        buffers = max(buffers, 2 * (2 * bj * head_dim + stages * 2 * bk * head_dim + bj * bk))
                    fits = bj * bk // threads <= 32 and 2 * bk * head_dim // threads <= 128  # S, dP; dK, dV
                if fits and buffers <= smem and not _miscompiled(head_dim, bj, mode):
                    tiles.append((bj, bk, warps, stages, mode))
    configs = []
    for bj, bk, warps, stages, mode in tiles:
        config = dict(block_j=bj, block_k=bk, num_warps=warps, num_stages=stages)
        if mode is None:
            configs.append(config)
        else:
            configs += [dict(config, dq_mode=mode, dropout_mask=option) for option in mask_options(bk)]
    return configs


def mask_options(block_k: int) -> tuple:
    """The ``DROPOUT_MASK_OPTIONS`` a kernel with key blocks of ``block_k`` can take: saving (or
    reading) the mask needs whole groups of Philox calls (``block_k % 64 == 0``)."""
    return tuple(o for o in DROPOUT_MASK_OPTIONS if o != "saved" or block_k % DECISION_GROUP == 0)


def _miscompiled(head_dim: int, block_j: int, dq_mode) -> bool:
    """Backward configurations whose compiled dK/dV kernel gives wrong dK on an H200 (triton 3.6,
    session 5 sweep, results/attention.md): head dim 128, 32-row j tiles, dQ "split", the mask
    regenerated. dK's error varied with stages and warps, from 2x the other variants' to 85x; the
    same kernel with the dQ atomics, or reading a saved mask, was right (a compiler fault, not
    isolated yet). Left out of the knob space (with either mask option) rather than offered."""
    return head_dim == 128 and block_j == 32 and dq_mode == "split"


# Defaults: the fastest configurations of benchmarks/attention.py's sweep on an H200
# (results/attention.md, session 5: dropout counters in groups of 64, (j, k) tiles in every kernel,
# the backward regenerating the mask, dQ "atomic" written by each head's last key block).
_GPU_DEFAULTS = {
    "forward": {64: dict(block_j=128, block_k=64, num_warps=8, num_stages=3),
                128: dict(block_j=64, block_k=64, num_warps=4, num_stages=3)},
    "backward": {64: dict(block_j=64, block_k=64, num_warps=4, num_stages=3, dq_mode="atomic",
                          dropout_mask="regenerate"),
                 128: dict(block_j=64, block_k=64, num_warps=4, num_stages=2, dq_mode="split",
                           dropout_mask="regenerate")},
}


def default_config(head_dim: int, direction: str, *, interpret: bool | None = None, groups: int = 1) -> dict:
    """The knob configuration the launchers use when none is given; ``groups``: query heads per K/V
    head (grouped-query attention), where the GPU backward's dQ runs "split" (H200, Llama-3.2-1B's
    attention, B=4 T=2048 H=32 KV=8 E=64 causal: 0.631 ms against 0.728 with the atomic dQ at the
    same tiles, ``benchmarks/results/attention_gqa.md``)."""
    _check_head_dim(head_dim)
    interpret = interpreted() if interpret is None else interpret
    if interpret:
        config = dict(block_j=16, block_k=DECISION_GROUP, num_warps=4, num_stages=1)  # whole groups: saved masks work
        return dict(config, dq_mode="atomic", dropout_mask="regenerate") if direction == "backward" else config
    table = _GPU_DEFAULTS[direction]
    if head_dim in table:
        config = dict(table[head_dim])
    else:
        config = dict(table[64]) if head_dim < 64 else attention_configs(head_dim, direction)[0]
    if direction == "backward" and groups > 1:
        config["dq_mode"] = "split"
    return config
