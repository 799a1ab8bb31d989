"""The fused attention's Python API (``kernels.attention``'s module doc): the launchers of its
forward and backward kernels with their checks, the dropout mask's logical strides and saved
buffer, and the autograd function."""
from __future__ import annotations

import math

import torch

from datamove.dataflow.dropout_mask import DECISION_GROUP
from datamove.kernels.attention.backward import _attn_bwd_dkdv_kernel, _attn_bwd_dq_kernel, _attn_bwd_preprocess_kernel
from datamove.kernels.attention.configs import DROPOUT_MASK_OPTIONS, _check_head_dim, default_config
from datamove.kernels.attention.forward import _attn_fwd_kernel
from datamove.kernels.launch import ceil_div, launch
from datamove.kernels.philox import dropout_scale, keep_threshold

LOG2E = 1.4426950408889634


def dropout_strides_for(order: str, B: int, H: int, Lq: int, Lk: int) -> tuple[int, int, int, int]:
    """Logical strides (sb, sh, sj, sk) of probabilities whose spec order is ``order`` (e.g. "hbjk")."""
    sizes = dict(b=B, h=H, j=Lq, k=Lk)
    if sorted(order) != sorted("bhjk"):
        raise ValueError(f"order {order!r} is not a permutation of 'bhjk'")
    strides, running = {}, 1
    for dim in reversed(order):
        strides[dim] = running
        running *= sizes[dim]
    return strides["b"], strides["h"], strides["j"], strides["k"]


def dropout_grouped(dropout_strides, offset: int) -> bool:
    """Whether the layout lets the kernels draw the mask one Philox call per sixteen keys: k is the
    mask's last logical letter (stride 1) and every row (b, h, j) starts a group of 64 counters (the
    offset and the other logical strides are multiples of 64; then L_k % 64 == 0 too). The kernels
    then do so with key blocks of whole groups (``_block_grouped``). Else one call per element."""
    sb, sh, sj, sk = dropout_strides
    return sk == 1 and all(x % DECISION_GROUP == 0 for x in (offset, sb, sh, sj))


def _block_grouped(grouped: bool, block_k: int, saved_mask) -> bool:
    """Whether a launch with key blocks of ``block_k`` draws one call per sixteen keys (``grouped``:
    the layout allows it); a saved mask needs it."""
    whole = grouped and block_k % DECISION_GROUP == 0
    if saved_mask is not None and not whole:
        raise ValueError(f"a saved dropout mask needs block_k a multiple of {DECISION_GROUP} (whole groups of "
                         f"Philox calls), not {block_k}")
    return whole


def new_saved_mask(q, k, *, dropout_p: float, offset: int = 0, dropout_strides=None):
    """A buffer for ``attention_forward(saved_mask=...)`` and ``attention_backward(dropout_mask=
    "saved", saved_mask=...)``: int16 (b, h, j, k // 16) on q's device, 16 bits per Philox call
    (see the module doc), or None where nothing is saved (dropout_p == 0, or a layout where the
    kernels draw one Philox call per element)."""
    B, H, Lq, _ = q.shape
    Lk = k.shape[2]
    drop = tuple(dropout_strides or dropout_strides_for("bhjk", B, H, Lq, Lk))
    if dropout_p == 0.0 or not dropout_grouped(drop, offset):
        return None
    return torch.empty((B, H, Lq, Lk // 16), device=q.device, dtype=torch.int16)


def _bias_args(biases: tuple, q, what: str, groups: int = 1) -> tuple:
    """Kernel arguments of ``biases``: logical (h, p) views of any strides in q's dtype and device
    (module doc: biases), or (None, ...) for none (placeholders, never read).  Not with grouped
    K/V heads (``groups`` > 1)."""
    if biases[0] is None:
        return (q,) * len(biases), (0,) * (2 * len(biases))
    if groups != 1:
        raise ValueError(f"{what}: biases are not taken with grouped K/V heads ({groups} query heads per K/V head)")
    H, P = q.shape[1], q.shape[3]
    if any(b is None or b.shape != (H, P) or b.dtype != q.dtype or b.device != q.device for b in biases):
        raise ValueError(f"{what} must be {'(h, p)' if len(biases) == 1 else 'each (h, p)'}: ({H}, {P}) in {q.dtype} "
                         f"on {q.device}")
    return tuple(biases), tuple(x for b in biases for x in b.stride())


def _prepare(q, k, v, dropout_p, offset, key_padding_mask, dropout_strides, saved_mask, groups):
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError("q, k, v must be 4-D logical (b, h, j|k, p) views")
    B, H, Lq, P = q.shape
    KV, Lk = k.shape[1], k.shape[2]
    if k.shape != (B, KV, Lk, P) or v.shape != (B, KV, Lk, P) or Lq == 0 or Lk == 0 or KV == 0 or H % KV:
        raise ValueError(f"shapes q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} do not match (k and v: "
                         f"(b, h / groups, k, p) for a whole number of groups)")
    if groups is not None and groups != H // KV:
        raise ValueError(f"groups={groups}: q has {H} heads and k, v {KV}, so {H // KV} query heads share each K/V head")
    if not (q.dtype == k.dtype == v.dtype) or q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError("q, k, v must share one dtype out of float16, bfloat16, float32")
    _check_head_dim(P)
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p {dropout_p} outside [0, 1)")
    if key_padding_mask is None:
        kpm, kpm_strides = q, (0, 0)  # placeholder pointer, never read
    else:
        if key_padding_mask.shape != (B, Lk) or key_padding_mask.dtype != torch.bool:
            raise ValueError(f"key_padding_mask must be bool of shape ({B}, {Lk})")
        kpm = key_padding_mask.view(torch.uint8)
        kpm_strides = kpm.stride()
    drop = tuple(dropout_strides or dropout_strides_for("bhjk", B, H, Lq, Lk))
    grouped = dropout_p > 0.0 and dropout_grouped(drop, offset)
    if saved_mask is not None and (not grouped or saved_mask.shape != (B, H, Lq, Lk // 16)
                                   or saved_mask.dtype != torch.int16 or not saved_mask.is_contiguous()):
        raise ValueError("saved_mask must come from new_saved_mask with the same arguments")
    last = offset + sum((n - 1) * s for n, s in zip((B, H, Lq, Lk), drop))
    return B, H, Lq, Lk, P, H // KV, kpm, kpm_strides, drop, grouped, last >= 2**31


def attention_forward(q, k, v, *, scale: float, dropout_p: float = 0.0, seed: int = 0, offset: int = 0,
                      causal: bool = False, key_padding_mask=None, dropout_strides=None, o=None, saved_mask=None,
                      bias=None, q_biased=None, groups=None, block_j=None, block_k=None, num_warps=None,
                      num_stages=None):
    """Forward pass. ``q``: (b, h, j, p), ``k``, ``v``: (b, h / G, k, p) logical views of any strides:
    with G > 1 (grouped-query attention), query head h attends over K/V head h // G; ``groups``
    (optional) states G, checked against the shapes.

    ``key_padding_mask``: bool (b, k), True = key excluded. ``dropout_strides``: logical strides
    (sb, sh, sj, sk) of the probabilities' dropout index (default: (b, h, j, k) row-major).
    ``o``: optional output (b, h, j, p) of any strides, else allocated like ``q``.
    ``saved_mask``: optional ``new_saved_mask`` buffer the kernel writes the keep decisions to
    (for a backward with ``dropout_mask="saved"``).  ``bias``: optional (bq, bv), each (h, p): the
    kernel attends over q + bq (rounded to q's dtype), k + bk for any bk, and v + bv, so a bias add
    before the attention needs no kernel of its own (module doc: biases); it writes q + bq into
    ``q_biased`` ((b, h, j, p) of any strides, required with ``bias``), the backward's q.
    Returns ``(o, lse)``, lse float32 (b, h, j) contiguous, natural log.
    """
    B, H, Lq, Lk, P, G, kpm, kpm_strides, drop, grouped, index_64 = _prepare(q, k, v, dropout_p, offset,
                                                                           key_padding_mask, dropout_strides,
                                                                           saved_mask, groups)
    config = default_config(P, "forward")
    block_j, block_k = block_j or config["block_j"], block_k or config["block_k"]
    o = torch.empty_like(q) if o is None else o
    lse = torch.empty((B, H, Lq), device=q.device, dtype=torch.float32)
    grid = (ceil_div(Lq, block_j), B * H)
    if bias is not None and (len(bias) != 2 or q_biased is None or q_biased.shape != q.shape):
        raise ValueError(f"bias must be (bq, bv) with q_biased, the {tuple(q.shape)} output q + bq is written to")
    biases, bias_strides = _bias_args(tuple(bias or (None, None)), q, "bias (bq, bv)", G)
    q_biased = q if q_biased is None else q_biased  # a placeholder without bias, never written
    launch(_attn_fwd_kernel, grid, [
        q, k, v, o, lse, kpm, lse if saved_mask is None else saved_mask, *biases, q_biased,
        *q.stride(), *k.stride(), *v.stride(), *o.stride(), *kpm_strides, *bias_strides, *q_biased.stride(), *drop,
        H, Lq, Lk, scale * LOG2E,
        keep_threshold(dropout_p), dropout_scale(dropout_p), seed, offset,
    ], dict(P=P, BLOCK_J=block_j, BLOCK_K=block_k,
            CAUSAL=causal, HAS_KPM=key_padding_mask is not None, HAS_DROPOUT=dropout_p > 0.0, INDEX_64=index_64,
            GROUPED=_block_grouped(grouped, block_k, saved_mask), MASK_IO=0 if saved_mask is None else 1,
            EVEN_K=Lk % block_k == 0, HAS_BIAS=bias is not None, GROUPS=G,
            num_warps=num_warps or config["num_warps"], num_stages=num_stages or config["num_stages"]))
    return o, lse


def attention_backward(do, q, k, v, o, lse, *, scale: float, dropout_p: float = 0.0, seed: int = 0,
                       offset: int = 0, causal: bool = False, key_padding_mask=None, dropout_strides=None,
                       saved_mask=None, dq=None, dk=None, dv=None, v_bias=None, groups=None, block_j=None,
                       block_k=None, num_warps=None, num_stages=None, dq_mode=None, dropout_mask=None):
    """Backward pass: ``(dq, dk, dv)`` for upstream ``do`` (b, h, j, p) of any strides; with
    grouped K/V heads (k, v: (b, h / G, k, p), ``attention_forward``) dk and dv are over the K/V
    heads, each the sum over its G query heads (one program per block of a K/V head's keys runs
    the group's query heads in turn into one accumulator: a fixed order, no atomics).

    ``o``, ``lse`` (and ``saved_mask``) come from ``attention_forward`` with the same arguments.
    ``dq``/``dk``/``dv``: optional outputs of any strides, else allocated like ``q``/``k``/``v``.
    ``dq_mode``: "atomic" (dQ added with fp32 atomics inside the dK/dV kernel, whose last key
    block per head writes it) or
    "split" (own kernel). ``dropout_mask`` (module doc): "regenerate" (``saved_mask`` None: the
    dK/dV kernel, and with "split" the dQ kernel, draw the mask from (seed, offset)) or "saved"
    (the kernels read ``saved_mask``, the forward's ``new_saved_mask`` buffer; None only where
    ``new_saved_mask`` gives None, and then the mask is drawn as with "regenerate").  After a
    forward with ``bias=(bq, bv)``: ``q`` is its ``q_biased``, ``k`` and ``v`` as given to it, and
    ``v_bias`` its bv (the gradients are those of the biased q, k, v, which are those of q, k, v).
    """
    B, H, Lq, Lk, P, G, kpm, kpm_strides, drop, grouped, index_64 = _prepare(q, k, v, dropout_p, offset,
                                                                           key_padding_mask, dropout_strides,
                                                                           saved_mask, groups)
    config = default_config(P, "backward", groups=G)
    block_j, block_k = block_j or config["block_j"], block_k or config["block_k"]
    num_warps, num_stages = num_warps or config["num_warps"], num_stages or config["num_stages"]
    dq_mode, dropout_mask = dq_mode or config["dq_mode"], dropout_mask or config["dropout_mask"]
    if dq_mode not in ("atomic", "split"):
        raise ValueError(f"dq_mode must be 'atomic' or 'split', not {dq_mode!r}")
    if dropout_mask not in DROPOUT_MASK_OPTIONS:
        raise ValueError(f"dropout_mask must be one of {DROPOUT_MASK_OPTIONS}, not {dropout_mask!r}")
    if (saved_mask is not None) != (dropout_mask == "saved" and grouped):
        given = "given" if saved_mask is not None else "None"
        raise ValueError(f"dropout_mask={dropout_mask!r} with saved_mask {given}: "
                         "'saved' reads the forward's new_saved_mask buffer (None where that is None), "
                         "'regenerate' takes none")
    atomic = dq_mode == "atomic"
    dq = torch.empty_like(q) if dq is None else dq
    dk = torch.empty_like(k) if dk is None else dk
    dv = torch.empty_like(v) if dv is None else dv
    delta = torch.empty((B, H, Lq), device=q.device, dtype=torch.float32)
    dq_acc = torch.empty((B, H, Lq, P), device=q.device, dtype=torch.float32) if atomic else delta
    arrivals = torch.empty((B, H), device=q.device, dtype=torch.int32) if atomic else delta
    mask, mask_io = (delta, 0) if saved_mask is None else (saved_mask, 2)  # delta: a placeholder pointer, never read
    launch(_attn_bwd_preprocess_kernel, (ceil_div(Lq, block_j), B * H),
           [o, do, delta, dq_acc, arrivals, *o.stride(), *do.stride(), H, Lq],
           dict(P=P, BLOCK_J=block_j, ZERO_DQ=atomic, num_warps=4))
    flags = dict(P=P, BLOCK_J=block_j, BLOCK_K=block_k, CAUSAL=causal, HAS_KPM=key_padding_mask is not None,
                 HAS_DROPOUT=dropout_p > 0.0, INDEX_64=index_64, GROUPED=_block_grouped(grouped, block_k, saved_mask),
                 MASK_IO=mask_io, HAS_BIAS=v_bias is not None, GROUPS=G,
                 EVEN=Lq % block_j == 0 and Lk % block_k == 0, num_warps=num_warps, num_stages=num_stages)
    biases, bias_strides = _bias_args((v_bias,), q, "v_bias", G)
    scalars = (H, Lq, Lk, scale, scale * LOG2E, keep_threshold(dropout_p), dropout_scale(dropout_p), seed, offset)
    launch(_attn_bwd_dkdv_kernel, (ceil_div(Lk, block_k), B * (H // G)), [
        q, k, v, do, lse, delta, dq_acc, arrivals, dq, dk, dv, kpm, mask, *biases,
        *q.stride(), *k.stride(), *v.stride(), *do.stride(), *dk.stride(), *dv.stride(), *dq.stride(), *kpm_strides,
        *bias_strides, *drop, *scalars], dict(DQ_ATOMIC=atomic, **flags))
    if not atomic:
        launch(_attn_bwd_dq_kernel, (ceil_div(Lq, block_j), B * H), [
            q, k, v, do, lse, delta, dq, kpm, mask, *biases,
            *q.stride(), *k.stride(), *v.stride(), *do.stride(), *dq.stride(), *kpm_strides, *bias_strides, *drop,
            *scalars], flags)
    return dq, dk, dv


class FusedAttention(torch.autograd.Function):
    """Autograd wrapper: ``FusedAttention.apply(q, k, v, scale, dropout_p, seed, offset, causal,
    key_padding_mask, dropout_strides, forward_config, backward_config)`` -> o (b, h, j, p). With
    the backward configuration's ``dropout_mask`` "saved" the forward writes the mask
    (``new_saved_mask``, where the layout allows) and the backward reads it; with "regenerate"
    the backward draws it again."""

    @staticmethod
    def forward(ctx, q, k, v, scale, dropout_p, seed, offset, causal, key_padding_mask, dropout_strides,
                forward_config, backward_config):
        backward_config = dict(default_config(q.shape[-1], "backward", groups=q.shape[1] // max(k.shape[1], 1)),
                               **(backward_config or {}))
        saved_mask = None
        if backward_config["dropout_mask"] == "saved":
            saved_mask = new_saved_mask(q, k, dropout_p=dropout_p, offset=offset, dropout_strides=dropout_strides)
        o, lse = attention_forward(q, k, v, scale=scale, dropout_p=dropout_p, seed=seed, offset=offset,
                                   causal=causal, key_padding_mask=key_padding_mask, dropout_strides=dropout_strides,
                                   saved_mask=saved_mask, **(forward_config or {}))
        ctx.save_for_backward(q, k, v, o, lse, key_padding_mask, saved_mask)
        ctx.args = dict(scale=scale, dropout_p=dropout_p, seed=seed, offset=offset, causal=causal,
                        dropout_strides=dropout_strides, **backward_config)
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse, key_padding_mask, saved_mask = ctx.saved_tensors
        dq, dk, dv = attention_backward(do, q, k, v, o, lse, key_padding_mask=key_padding_mask,
                                        saved_mask=saved_mask, **ctx.args)
        return dq, dk, dv, None, None, None, None, None, None, None, None, None


def fused_attention(q, k, v, *, scale: float | None = None, dropout_p: float = 0.0, seed: int | None = None,
                    offset: int = 0, causal: bool = False, key_padding_mask=None, dropout_strides=None,
                    forward_config: dict | None = None, backward_config: dict | None = None):
    """Differentiable fused attention over logical (b, h, j, p) views; returns O (b, h, j, p).

    ``scale`` defaults to 1/sqrt(p); ``seed`` defaults to a draw from torch's default generator.
    ``forward_config``/``backward_config``: knob dicts as listed by ``attention_configs`` (a partial
    dict takes the rest from ``default_config``); ``backward_config["dropout_mask"]`` chooses
    whether the forward saves the dropout mask for the backward or the backward regenerates it.
    """
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    if seed is None:
        seed = int(torch.randint(0, 2**62, (1,)).item())
    return FusedAttention.apply(q, k, v, scale, dropout_p, seed, offset, causal, key_padding_mask,
                                dropout_strides, forward_config, backward_config)
