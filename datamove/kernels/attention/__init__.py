"""Fused multi-head attention (flash-attention manner) with Philox dropout, for any tensor layout.

The operator found by the fusion pass, over named dims b (batch), h (head), j (query position),
k (key position), p (head dim):

    S[b,h,j,k] = scale * sum_p Q[b,h,j,p] K[b,h,k,p]
    S          = -inf where masked (causal: k > j; key padding: key_padding_mask[b,k] is True)
    P          = softmax_k(S)
    P~         = P * keep[b,h,j,k] * dropout_scale(dropout_p)   (1 / (1 - dropout_p), p rounded to 1/256)
    O[b,h,j,p] = sum_k P~[b,h,j,k] V[b,h,k,p]

The forward pass streams K/V blocks through an online softmax; P never reaches memory. It saves
the logsumexp ``lse[b,h,j] = log sum_k exp(S)`` (float32, natural log) for the backward pass,
which recomputes P from Q, K and lse. Backward: a preprocess kernel (delta = rowsum(dO * O)), a
kernel over key blocks for dK and dV that also adds dQ with fp32 atomics into a zeroed buffer, the
last of a head's key blocks to finish writing the head's dQ in dQ's dtype and layout (an arrival
counter per (b, h): no separate cast kernel; "atomic"), or a second kernel over query blocks for
dQ ("split"). Every kernel computes score tiles (j, k), rows j: the
dropout decisions of a Philox call then lie in the accumulator columns of the thread that draws
it (module doc below); the dK/dV kernel feeds P~ and dS to its MMAs transposed.

Grouped-query attention (GQA, Llama's K/V heads shared by G query heads each): K and V (and dK,
dV) are over H / G heads, query head h reading K/V head h // G (the kernels' ``GROUPS``; the
launchers take it from the shapes, k and v (b, h / G, k, p), and check ``groups`` where given);
the K/V tensors are read in place, never repeated over the query heads.  O, lse, dO, dQ, delta and
the dropout mask stay over the query heads (b, h, j, k), indexed as without groups.  Backward:
one dK/dV program per block of one K/V head's keys (grid: key blocks x b * H / G) runs its
group's G query heads in turn, in head order, through its loop over query blocks, summing into
one fp32 dK and dV accumulator (deterministic, no atomics, no per-query-head dK/dV buffer to sum
afterwards: FlashAttention-2 writes dK/dV per query head and sums them in a second pass; here
the group's sum never leaves the registers, and K and V are loaded once per group); with dQ
"atomic" each query head's dQ is written by the last key block to finish that head (its arrival
counter), as without groups; the dQ kernel ("split") runs per query head, reading K/V head h // G.
The forward and the dQ kernel are unchanged but for the K/V head's index; with G = 1 every kernel
compiles to the code it compiled to before groups existed.  Biases (below) are refused with G > 1.

Layouts: every tensor is addressed through one stride per named dim, so any permuted storage
(``(b,h,j,p)``, BERT's ``(b,j,h,p)`` = ``[B, L, H*P]`` view, the paper's ``(p,h,b,j)``) works
without copies. The launchers take torch tensors whose ``.shape`` is the logical order
(b, h, j, p) / (b, h, k, p) (pass permuted views) and read ``.stride()``.

Dropout convention (``kernels.philox`` / ``dataflow.dropout_mask``): the probability at logical
position (b, h, j, k) has logical index ``n = b*sb + h*sh + j*sj + k*sk``, where (sb, sh, sj, sk)
are the row-major strides of the probabilities' dims in their spec order (``dropout_strides_for``);
it is kept iff the convention's 8-bit value of counter ``g = offset + n`` (``g = 64 G + 8 i + 2 t + e``:
byte ``2 i + e`` of Philox call ``4 G + t``) is ``>= keep_threshold(dropout_p)``, and kept ones are
scaled by ``dropout_scale(dropout_p)``.  Where k is the mask's last logical letter and every row
starts a group of 64 counters (``dropout_grouped``: the offset and the strides of b, h, j multiples
of 64, e.g. BERT's (h, b, j, k) and (b, h, j, k) masks with L % 64 == 0) and the key blocks are
whole groups (block_k % 64 == 0), the kernels draw one Philox call per sixteen keys, each in the
thread whose accumulator columns it decides (``kernels.philox.dropout_keep_grouped``); elsewhere
one call per element (``kernels.philox.dropout_keep``).

How the backward gets the mask is the knob ``dropout_mask`` of its configuration
(``attention_configs``, ``attention_backward``, ``fused_attention``'s ``backward_config``):

- "regenerate" (the default): the backward saves nothing and reads nothing; every kernel that
  needs the mask draws it again from (seed, offset): the dK/dV kernel, and with dQ "split" the
  dQ kernel too.
- "saved": the forward writes the decisions, 16 bits per Philox call: int16 (b, h, j, k // 16)
  contiguous, bit ``2 i + e`` of [b, h, j, c] = the decision of key ``64 (c // 4) + 8 i + 2 (c % 4) + e``
  (``new_saved_mask``; 1/8 byte per probability; blocks a causal forward skips stay unwritten and
  are never read unmasked), and the backward kernels read it instead of drawing.  Only where the
  layout lets the kernels draw one call per sixteen keys (elsewhere nothing is saved and the backward draws the mask,
  as "regenerate"), and only with key blocks of whole groups (block_k % 64 == 0) on both sides.

Fully masked rows (every key padded) give O = 0, zero gradients and lse = +inf.

Biases (``bias=(bq, bv)``, each (h, p)): the attention over q + bq, k + bk and v + bv, the bias
add before it (BERT's Q/K/V) folded in.  The forward forms q + bq as it loads q, rounded to q's
dtype as a bias-add kernel would store it, and writes it out (``q_biased``) for the backward, which
reads it as its q: the dK/dV kernel's q tiles then go from their pipelined loads straight into its
MMAs (adding bq to each tile there made the backward 18% slower at BERT-large B=8 L=512 on the
H200).  k's bias needs no argument: it adds (q_j + bq) . bk to every score of row j, which the
softmax cancels, and dQ = dS (k + bk) = dS k since each row of dS sums to 0 (leaving it out also
keeps dQ clear of that sum's rounding times bk); lse is then the one of the scores without it,
which only the backward reads.  v's bias (``v_bias`` in the backward): the forward adds
(sum_k P~) bv to O once after its loop (fp32); dP~ = dO (v + bv)^T takes v + bv formed once per
key block in the dK/dV kernel (rounded to v's dtype) and the row term dO_j . bv (fp32) in the dQ
kernel.

Arithmetic: fp16/bf16 (or fp32, TF32 dots on GPU) operands, fp32 accumulation and statistics;
the softmax runs in base 2 with log2(e) folded into the scale.

The package: ``tiles`` (the Triton functions the kernels share), ``forward`` and ``backward`` (the
kernels), ``configs`` (their knobs and defaults), ``launchers`` (the Python API: launches, checks,
the saved mask, the autograd function).
"""
from datamove.kernels import philox
from datamove.kernels.attention import backward, forward, launchers, tiles
# the kernels themselves, for tests/compile_attention.py and benchmarks/attention_layouts.py
from datamove.kernels.attention.backward import (_attn_bwd_dkdv_kernel, _attn_bwd_dq_kernel,  # noqa: F401
                                                 _attn_bwd_preprocess_kernel)
from datamove.kernels.attention.configs import (DROPOUT_MASK_OPTIONS, attention_configs, default_config, mask_options,
                                                supported_head_dim)
from datamove.kernels.attention.forward import _attn_fwd_kernel  # noqa: F401
from datamove.kernels.attention.launchers import (LOG2E, FusedAttention, attention_backward, attention_forward,
                                                  dropout_grouped, dropout_strides_for, fused_attention, new_saved_mask)
from datamove.kernels.device import source_id

# the kernels' source version: a timing holds for it
KERNEL_ID = source_id(tiles.__file__, forward.__file__, backward.__file__, launchers.__file__, philox.__file__)

__all__ = ["DROPOUT_MASK_OPTIONS", "KERNEL_ID", "LOG2E", "FusedAttention", "attention_backward", "attention_configs",
           "attention_forward", "default_config", "dropout_grouped", "dropout_strides_for", "fused_attention",
           "mask_options", "new_saved_mask", "supported_head_dim"]
