"""cuDNN's fused attention (FlashAttention-style, Hopper wgmma kernels) through PyTorch's ATen ops,
as an implementation of the same attention the generated kernels run (``kernels.attention``):
forward and backward as separate calls on logical (b, h, j, p) views, grouped-query attention
(K/V over fewer heads, read in place), causal or not, without dropout, biases or a key-padding
mask (``cudnn_refusal`` says which inputs it takes).

Its statistics are the generated kernels': lse float32 (b, h, j), the natural-log logsumexp of
the scaled scores, so a cuDNN forward's lse feeds the generated backward and the other way round
(``tests/test_attention_library_gpu.py`` checks both pairings against float64).

Layouts: q, k, v, o and do may be stored in any order whose head dim p is innermost (stride 1;
cuDNN's requirement); cuDNN writes o like q, dq like q and dk, dv like k and v (checked by the
callers that need a planned layout: ``families.attention.launch``).  The head dim is a multiple
of 8 up to 128 (cuDNN's sm90 kernels), the dtype float16 or bfloat16, the device a CUDA GPU.
"""
from __future__ import annotations

import torch

_aten = torch.ops.aten
HEAD_DIMS = range(8, 129, 8)
DTYPES = (torch.float16, torch.bfloat16)


def cudnn_refusal(P: int, dtype: torch.dtype, device, *, dropout_p: float = 0.0, bias: bool = False,
                  layout: str = "bhjp") -> str | None:
    """Why cuDNN's attention cannot run this case (None: it can).  ``layout``: the storage order of
    (b, h, j, p) the tensors are in."""
    if torch.device(device).type != "cuda" or not torch.backends.cudnn.is_available():
        return "cuDNN's attention runs on a CUDA GPU with cuDNN"
    if dtype not in DTYPES:
        return f"cuDNN's attention takes float16 or bfloat16, not {dtype}"
    if P not in HEAD_DIMS:
        return f"head dim {P}: cuDNN's attention takes multiples of 8 up to 128"
    if dropout_p:
        return "with dropout (cuDNN's mask cannot be regenerated to check it)"
    if bias:
        return "with a bias add folded in"
    if not layout.endswith("p"):
        return f"layout {layout}: cuDNN needs the head dim innermost"
    return None


def cudnn_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float,
                  causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(o, lse): o (b, h, j, p) stored like q, lse float32 (b, h, j) contiguous (natural log).
    ``q``: (b, h, j, p); ``k``, ``v``: (b, h / G, k, p) (grouped-query attention for G > 1)."""
    out = _aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, causal, False, scale=scale)
    return out[0], out[1].view(out[1].shape[:3])


def cudnn_backward(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor,
                   lse: torch.Tensor, *, scale: float, causal: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) of the attention whose forward gave ``o`` and ``lse`` (this module's or the
    generated kernels'); dq stored like q, dk and dv like k and v (over the K/V heads)."""
    unused = torch.empty(0, dtype=torch.int64, device=q.device)  # dropout's Philox seed and offset: no dropout
    return _aten._scaled_dot_product_cudnn_attention_backward(
        do, q, k, v, o, lse.unsqueeze(-1), unused, unused, None, None, None, q.shape[2], k.shape[2], 0.0, causal,
        scale=scale)
