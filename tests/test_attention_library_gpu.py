"""cuDNN's attention (``kernels.attention.library``) against float64, alone and paired with the
generated kernels (a forward of one, the backward of the other: the statistics are shared), at odd
sizes, grouped-query and causal (marker ``gpu``)."""
from __future__ import annotations

import pytest
import torch

from datamove.families.attention.variants import AttentionCase, Workspace
from datamove.kernels.attention import attention_backward, attention_forward
from datamove.kernels.attention.library import cudnn_backward, cudnn_forward, cudnn_refusal

pytestmark = pytest.mark.gpu

CASES = [  # B, H, KV, L, P, layout
    (2, 4, 2, 127, 64, "bjhp"),
    (1, 6, 6, 200, 128, "bhjp"),
    (3, 8, 2, 96, 64, "hbjp"),
]


def _run(ws: Workspace, forward: str, backward: str) -> dict:
    c = ws.case
    x = ws.inputs()
    args = dict(scale=c.scale, causal=c.causal)
    if forward == "cudnn":
        o, lse = cudnn_forward(x["q"], x["k"], x["v"], **args)
    else:
        o, lse = attention_forward(x["q"], x["k"], x["v"], **args)
    if backward == "cudnn":
        dq, dk, dv = cudnn_backward(x["do"], x["q"], x["k"], x["v"], o, lse, **args)
    else:
        dq, dk, dv = attention_backward(x["do"], x["q"], x["k"], x["v"], o, lse, **args)
    return dict(o=o, dq=dq, dk=dk, dv=dv, lse=lse)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("B,H,KV,L,P,layout", CASES)
@pytest.mark.parametrize("forward,backward", [("cudnn", "cudnn"), ("cudnn", "fused"), ("fused", "cudnn")])
def test_matches_float64_alone_and_paired_with_the_generated_kernels(B, H, KV, L, P, layout, causal, forward, backward):
    ws = Workspace(AttentionCase(B, H, L, P, 0.0, layout=layout, causal=causal, KV=KV), "cuda")
    assert cudnn_refusal(P, ws.case.dtype, "cuda", layout=layout) is None
    results = _run(ws, forward, backward)
    verdict = ws.verdict(results)
    assert verdict.passed, str(verdict)
    fused = _run(ws, "fused", "fused")
    torch.testing.assert_close(results["lse"], fused["lse"], rtol=0, atol=2e-2)  # the same statistics
    if forward == "cudnn":  # cuDNN writes o like q, its gradients like their inputs
        x = ws.inputs()
        assert results["o"].stride() == x["q"].stride()
    if backward == "cudnn":
        x = ws.inputs()
        assert results["dq"].stride() == x["q"].stride() and results["dk"].stride() == x["k"].stride()


def test_refusals_name_the_reason():
    assert "dropout" in cudnn_refusal(64, torch.bfloat16, "cuda", dropout_p=0.1)
    assert "head dim" in cudnn_refusal(72 + 1, torch.bfloat16, "cuda")
    assert "innermost" in cudnn_refusal(64, torch.bfloat16, "cuda", layout="bhpj")
    assert "float16 or bfloat16" in cudnn_refusal(64, torch.float32, "cuda")
