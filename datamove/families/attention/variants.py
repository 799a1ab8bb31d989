"""The fused attention's variants for ``harness.bench.Sweep`` (forward, backward, both), and its baselines.

One ``AttentionCase``: dims b, h, j (queries), k (keys, = j), p (head dim), dropout probability,
dtype and the storage order of Q, K, V, O, dO and the gradients (``layout``, over (b, h, j, p);
e.g. BERT's ``"bjhp"`` = ``[B, L, H*P]``); with ``KV`` < H, grouped-query attention: K, V (and
dK, dV) over KV heads, H / KV query heads sharing each (the fused kernels read them in place; the
references, the eager chain and the checks repeat them over the query heads first, as HF's
``repeat_kv``; SDPA gets ``enable_gqa``).  Implementations:

- ``FusedVariant``: ``kernels.attention`` with one knob configuration (``attention_configs``) per
  pass: direction "forward" (``attention_forward`` as training runs it with the backward
  configuration's ``dropout_mask``, by default "regenerate": nothing saved; "saved": writing the
  dropout mask, ``new_saved_mask``), "backward" (``attention_backward`` on O, lse and, with
  ``dropout_mask`` "saved", the saved mask of a default-knob forward), or "fwd+bwd"
  (``fused_attention`` + ``.backward(dO)``, a pair of configurations);
- ``CudnnVariant``: cuDNN's attention through its ATen ops (``kernels.attention.library``), forward
  or backward alone (the backward on a cuDNN forward's O and lse), where ``cudnn_refusal`` allows
  (no dropout, no bias, head dim innermost): a candidate of the plan beside the fused kernels;
- ``SdpaVariant``: ``torch.nn.functional.scaled_dot_product_attention`` with one backend forced
  through ``torch.nn.attention.sdpa_kernel`` ("flash", "efficient", "cudnn", "math"), or
  "default" (PyTorch's choice); a backend that refuses the inputs fails at build;
- ``EagerVariant``: the unfused chain, einsum, scale, softmax, ``torch.native_dropout``, einsum.

Checks, against float64 (``Workspace``: float64 inputs N(0, 1), rounded to ``dtype``, reference
by torch autograd in float64; ``harness.sweep_variants.judge``, baseline: the eager chain in
``dtype`` on the same inputs with the same mask): fused: O and every gradient with the mask
regenerated from (seed, offset) (``dataflow.dropout_mask``); eager: against the reference with
the mask that ``native_dropout`` drew in the checked call; SDPA: its dropout mask cannot be
regenerated, so the check runs it with dropout 0 against the dropout-0 reference (the timed run
uses ``dropout_p``), and on a GPU the verdict names the attention kernels the timed call launched.

Keys: ``op`` = ``"attention:<direction>:dropout=<p>"`` (``":bias"`` appended where biases (h, p) are
added to q, k, v, the bias add folded into the fused kernels: ``kernels.attention``'s biases,
``AttentionCase.bias``, forward and backward only), ``dims`` = {b, h, j, k, p} (and ``kv``, the
K/V heads, with grouped-query attention), ``layout`` =
{tensor: storage order}, ``knobs`` = {"impl": "fused", "kernel": ``kernels.attention.KERNEL_ID``,
"forward": {...}, "backward": {...}} (direction "forward": {"impl": "fused", "kernel": ..., "forward":
{...}, "dropout_mask": ...}) /
{"impl": "cudnn"} / {"impl": "sdpa", "backend": ...} / {"impl": "eager"}, plus "launch": "cuda-graph" or "python"
(how the benchmark times it: ``Sweep(cuda_graph=True/False)``).  ``flop``: forward 4 BHLLP,
backward 10 BHLLP (five products), both 14 BHLLP; ``bytes``: Q, K, V, O (forward) and dO, dQ, dK,
dV (backward) x the item size, K, V, dK, dV over the K/V heads (lse and masks not counted).
"""
from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass, replace

import torch

from datamove.dtypes import parse as parse_dtype
from datamove.kernels.attention import (DROPOUT_MASK_OPTIONS, KERNEL_ID, attention_backward, attention_configs,
                                        attention_forward, default_config, fused_attention, mask_options, new_saved_mask)
from datamove.kernels.attention.library import cudnn_backward, cudnn_forward, cudnn_refusal
from datamove.harness.sweep_variants import Verdict, judge
from datamove.kernels.philox import dropout_scale
from datamove.harness.torch_eval import keep_mask_torch

DTYPE = torch.bfloat16
SEED = 0x5EED  # dropout seed; the mask's offset is 0, its logical index over (b, h, j, k) row-major
DIRECTIONS = ("forward", "backward", "fwd+bwd")
SDPA_BACKENDS = ("default", "flash", "efficient", "cudnn", "math")
LAUNCHES = ("cuda-graph", "python")
NAMES = ("o", "dq", "dk", "dv")
BIASES = ("bq", "bk", "bv")


@dataclass(frozen=True)
class AttentionCase:
    B: int
    H: int
    L: int
    P: int
    dropout_p: float
    layout: str = "bjhp"  # storage order of the (b, h, j, p) tensors; K and V: the same with k for j
    dtype: torch.dtype = DTYPE
    bias: bool = False  # biases (h, p) added to q, k, v, folded into the kernels (fused variants only)
    causal: bool = False  # query j attends to keys k <= j only
    KV: int | None = None  # K/V heads (grouped-query attention: H / KV query heads share each); None: H

    @property
    def kv_heads(self) -> int:
        return self.H if self.KV is None else self.KV

    @property
    def grouped(self) -> bool:
        """Whether K and V have fewer heads than Q (grouped-query attention, read in place)."""
        return self.kv_heads != self.H

    @property
    def dims(self) -> dict:
        """{b, h, j, k, p}, and with grouped-query attention "kv" (K/V heads): the key of an
        ungrouped case is the one it always had."""
        dims = dict(b=self.B, h=self.H, j=self.L, k=self.L, p=self.P)
        return dict(dims, kv=self.kv_heads) if self.grouped else dims

    @property
    def scale(self) -> float:
        return self.P ** -0.5

    def op(self, direction: str) -> str:
        return f"attention:{direction}:dropout={self.dropout_p:g}" + (":bias" if self.bias else "") \
            + (":causal" if self.causal else "")

    def layouts(self) -> dict:
        key_layout = self.layout.replace("j", "k")
        return dict(q=self.layout, k=key_layout, v=key_layout, o=self.layout, do=self.layout)

    def flop(self, direction: str) -> int:
        pairs = self.L * (self.L + 1) // 2 if self.causal else self.L * self.L  # (query, key) pairs computed
        return {"forward": 4, "backward": 10, "fwd+bwd": 14}[direction] * self.B * self.H * pairs * self.P

    def bytes(self, direction: str) -> int:
        """Q, O (and dO, dQ) over the query heads, K, V (and dK, dV) over the K/V heads."""
        tensors = 2 if direction == "forward" else 4  # per head set: forward Q, O / K, V; else also dO, dQ / dK, dV
        return tensors * (self.H + self.kv_heads) * self.B * self.L * self.P * self.dtype.itemsize

    def args(self, dropout_p: float | None = None) -> dict:
        p = self.dropout_p if dropout_p is None else dropout_p
        return dict(scale=self.scale, dropout_p=p, seed=SEED, offset=0, causal=self.causal)


def stored_as(t: torch.Tensor, order: str) -> torch.Tensor:
    """The logical (b, h, j, p) tensor ``t`` copied into storage order ``order``, returned as a logical view."""
    stored = t.permute(["bhjp".index(d) for d in order]).contiguous()
    return stored.permute([order.index(d) for d in "bhjp"])


def _chain(q, k, v, scale, keep, keep_scale, causal: bool = False):
    """The eager chain at the inputs' precision; ``keep`` (b, h, j, k) bool or None, kept
    probabilities multiplied by ``keep_scale``; ``causal``: keys after the query masked."""
    a = torch.softmax(_masked(torch.einsum("bhjp,bhkp->bhjk", q, k) * scale, causal), dim=-1)
    if keep is not None:
        a = a * keep.to(a.dtype) * keep_scale
    return torch.einsum("bhjk,bhkp->bhjp", a, v)


def _repeated(case: AttentionCase, k, v) -> tuple:
    """K and V over the query heads: with grouped-query attention each K/V head repeated over its
    group (HF's ``repeat_kv``), else as they are."""
    if not case.grouped:
        return k, v
    return tuple(t.repeat_interleave(case.H // case.kv_heads, dim=1) for t in (k, v))


def _masked(scores: torch.Tensor, causal: bool) -> torch.Tensor:
    """``scores`` (b, h, j, k) with -inf where k > j when ``causal``."""
    if not causal:
        return scores
    j, k = scores.shape[-2:]
    return scores.masked_fill(torch.ones(j, k, dtype=torch.bool, device=scores.device).triu(1), float("-inf"))


class Workspace:
    """Inputs of one case (float64 logical, and in ``dtype`` stored in the case's layout) and the
    float64 reference / eager baseline per mask, computed on first use."""

    def __init__(self, case: AttentionCase, device, seed: int = 0):
        self.case, self.device, self.seed = case, torch.device(device), seed

    def __getstate__(self) -> dict:
        """Pickled (for a measuring process) without the tensors it computed: rebuilt there on first use."""
        return {name: value for name, value in self.__dict__.items() if name not in ("exact", "keep")}

    @functools.cached_property
    def exact(self) -> dict:
        """Float64 q, k, v, do (b, h, j|k, p), and with ``case.bias`` bq, bk, bv (h, p), rounded
        through ``dtype`` so every implementation reads the same values."""
        c = self.case
        gen = torch.Generator().manual_seed(self.seed)
        shapes = {n: (c.B, c.kv_heads if n in ("k", "v") else c.H, c.L, c.P) for n in ("q", "k", "v", "do")}
        shapes.update({n: (c.H, c.P) for n in (BIASES if c.bias else ())})
        return {n: torch.randn(shape, generator=gen, dtype=torch.float64).to(c.dtype).to(self.device, torch.float64)
                for n, shape in shapes.items()}

    def inputs(self) -> dict:
        """Fresh q, k, v, do in ``dtype``, stored in the case's layout (logical views), and the biases."""
        return {n: t.to(self.case.dtype) if n in BIASES else stored_as(t.to(self.case.dtype), self.case.layout)
                for n, t in self.exact.items()}

    @functools.cached_property
    def keep(self) -> torch.Tensor | None:
        c = self.case
        if c.dropout_p == 0:
            return None
        return keep_mask_torch(SEED, 0, (c.B, c.H, c.L, c.L), c.dropout_p, self.device)

    def _run_chain(self, dtype, keep, keep_scale) -> dict:
        x = {n: t.to(dtype, copy=True).requires_grad_(n in ("q", "k", "v")) for n, t in self.exact.items()}
        q, k, v = (x[n] + x[b][None, :, None, :] if self.case.bias else x[n] for n, b in zip("qkv", BIASES))
        k, v = _repeated(self.case, k, v)
        o = _chain(q, k, v, self.case.scale, keep, keep_scale, self.case.causal)
        o.backward(x["do"])
        return dict(o=o.detach(), dq=x["q"].grad, dk=x["k"].grad, dv=x["v"].grad)

    @functools.lru_cache(maxsize=2)
    def expected(self, dropout: bool = True) -> tuple[dict, dict]:
        """(float64 reference, eager baseline in ``dtype``) of O, dQ, dK, dV with the case's mask
        (``dropout``) or without dropout."""
        keep, keep_scale = (self.keep, dropout_scale(self.case.dropout_p)) if dropout else (None, 1.0)
        return self._run_chain(torch.float64, keep, keep_scale), self._run_chain(self.case.dtype, keep, keep_scale)

    def verdict(self, results: dict, dropout: bool = True, expected=None) -> Verdict:
        reference, baseline = expected or self.expected(dropout)
        return Verdict(tuple((n, judge(results[n], baseline[n], reference[n])) for n in NAMES if n in results))


@dataclass(frozen=True)
class NotedVerdict:
    """A ``Verdict`` with a note (what was checked, which kernels ran)."""

    verdict: Verdict
    note: str

    passed = property(lambda self: self.verdict.passed)
    error = property(lambda self: self.verdict.error)
    baseline_error = property(lambda self: self.verdict.baseline_error)

    def __str__(self) -> str:
        return f"{self.verdict}; {self.note}"


class _Base:
    """Common key fields and fwd+bwd plumbing; subclasses define ``_forward(x)`` -> o."""

    impl: dict

    def __init__(self, ws: Workspace, direction: str, launch: str = "cuda-graph"):
        if direction not in DIRECTIONS or launch not in LAUNCHES:
            raise ValueError(f"direction {direction!r} / launch {launch!r}")
        case = ws.case
        self.ws, self.direction = ws, direction
        self.op, self.dims, self.dtype = case.op(direction), case.dims, parse_dtype(case.dtype).name
        self.layout = case.layouts()
        self.knobs = dict(self.impl, launch=launch)
        self.flop, self.bytes = case.flop(direction), case.bytes(direction)
        self.x = None

    def build(self) -> None:
        self.x = self.ws.inputs()
        for n in ("q", "k", "v"):
            self.x[n].requires_grad_(self.direction == "fwd+bwd")
        self.run()

    def run(self) -> dict:
        if self.direction == "forward":
            with torch.no_grad():
                return dict(o=self._forward())
        return self._fwd_bwd()

    def _fwd_bwd(self) -> dict:
        x = self.x
        for n in ("q", "k", "v"):
            x[n].grad = None  # a CUDA graph captured around this call then owns the gradients
        o = self._forward()
        o.backward(x["do"])
        return dict(o=o, dq=x["q"].grad, dk=x["k"].grad, dv=x["v"].grad)


class FusedVariant(_Base):
    """``kernels.attention`` with knob configurations ``forward`` / ``backward`` (None: the default).
    Direction "forward" keeps only ``backward``'s ``dropout_mask`` (knob "dropout_mask": whether the
    forward writes the mask for the backward, "saved", or not, "regenerate")."""

    def __init__(self, ws: Workspace, direction: str, forward: dict | None = None, backward: dict | None = None,
                 launch: str = "cuda-graph"):
        P = ws.case.P
        if ws.case.bias and direction == "fwd+bwd":
            raise ValueError("biased cases run the forward and the backward kernels, not fused_attention")
        if ws.case.bias and ws.case.grouped:
            raise ValueError("the kernels take no biases with grouped K/V heads")
        backward = dict(default_config(P, "backward", groups=ws.case.H // ws.case.kv_heads), **(backward or {}))
        self.forward = dict(forward or default_config(P, "forward")) if direction != "backward" else None
        self.backward = backward if direction != "forward" else None
        self.dropout_mask = backward["dropout_mask"]
        self.impl = {"impl": "fused", "kernel": KERNEL_ID, **({"forward": self.forward} if self.forward else {}),
                     **({"backward": self.backward} if self.backward else {"dropout_mask": self.dropout_mask})}
        super().__init__(ws, direction, launch)

    def _forward(self):
        return fused_attention(self.x["q"], self.x["k"], self.x["v"], **self.ws.case.args(),
                               forward_config=self.forward, backward_config=self.backward)

    def run(self) -> dict:
        x, args = self.x, self.ws.case.args()
        if self.direction == "fwd+bwd":
            return self._fwd_bwd()
        biased = {}  # the reference adds bk too: the kernels need not (``kernels.attention``: biases)
        if self.ws.case.bias:
            x.setdefault("q_biased", torch.empty_like(x["q"]))
            biased = dict(bias=(x["bq"], x["bv"]), q_biased=x["q_biased"])
        if "saved_mask" not in x:
            x["saved_mask"] = new_saved_mask(x["q"], x["k"], dropout_p=args["dropout_p"],
                                             offset=args["offset"]) if self.dropout_mask == "saved" else None
        if self.direction == "forward":
            return dict(o=attention_forward(x["q"], x["k"], x["v"], **args, **biased, saved_mask=x["saved_mask"],
                                            **self.forward)[0])
        if "o" not in x:
            x["o"], x["lse"] = attention_forward(x["q"], x["k"], x["v"], **args, **biased, saved_mask=x["saved_mask"])
        q, v_bias = (x["q_biased"], x["bv"]) if biased else (x["q"], None)
        dq, dk, dv = attention_backward(x["do"], q, x["k"], x["v"], x["o"], x["lse"], **args, v_bias=v_bias,
                                        saved_mask=x["saved_mask"], **self.backward)
        return dict(dq=dq, dk=dk, dv=dv)

    def check(self) -> Verdict:
        return self.ws.verdict(self.run())

    def compile_task(self) -> tuple:
        """(function, args) compiling this variant's kernels in another process (``harness.bench.Sweep``)."""
        return _compile_ahead, (self.ws.case, self.direction, self.forward, self.backward or
                                {"dropout_mask": self.dropout_mask})


def _compile_ahead(case: AttentionCase, direction: str, forward: dict | None, backward: dict) -> None:
    """Build (the kernels compile at their first launch, into Triton's disk cache) one fused variant."""
    FusedVariant(Workspace(case, "cuda"), direction, forward, backward).build()
    torch.cuda.synchronize()


class CudnnVariant(_Base):
    """cuDNN's attention (``kernels.attention.library``), direction "forward" or "backward" (on
    the O and lse of a cuDNN forward of the same inputs, computed once at build)."""

    impl = {"impl": "cudnn"}

    def __init__(self, ws: Workspace, direction: str, launch: str = "cuda-graph"):
        case = ws.case
        why = cudnn_refusal(case.P, case.dtype, ws.device, dropout_p=case.dropout_p, bias=case.bias,
                            layout=case.layout)
        if why is not None or direction not in ("forward", "backward"):
            raise ValueError(f"cuDNN's attention, direction {direction!r}: {why or 'forward or backward only'}")
        super().__init__(ws, direction, launch)

    def run(self) -> dict:
        x, case = self.x, self.ws.case
        args = dict(scale=case.scale, causal=case.causal)
        if self.direction == "forward":
            return dict(o=cudnn_forward(x["q"], x["k"], x["v"], **args)[0])
        if "o" not in x:
            x["o"], x["lse"] = cudnn_forward(x["q"], x["k"], x["v"], **args)
        dq, dk, dv = cudnn_backward(x["do"], x["q"], x["k"], x["v"], x["o"], x["lse"], **args)
        return dict(dq=dq, dk=dk, dv=dv)

    def check(self) -> Verdict:
        return self.ws.verdict(self.run())


def library_variants(ws: Workspace) -> list:
    """cuDNN's forward and backward at ``ws``'s case, none where ``cudnn_refusal`` refuses it."""
    case = ws.case
    if cudnn_refusal(case.P, case.dtype, ws.device, dropout_p=case.dropout_p, bias=case.bias, layout=case.layout):
        return []
    return [CudnnVariant(ws, direction) for direction in ("forward", "backward")]


def _sdpa_context(backend: str):
    if backend == "default":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([{"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
                         "cudnn": SDPBackend.CUDNN_ATTENTION, "math": SDPBackend.MATH}[backend]])


def attention_kernel_names(fn) -> list[str]:
    """Names of the attention kernels one call of ``fn`` launches on the GPU (from the profiler)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    keys = ("flash", "fmha", "efficient", "cudnn", "attention", "mem_eff")
    return sorted({e.key[:90] for e in prof.key_averages() if any(k in e.key.lower() for k in keys)})


class SdpaVariant(_Base):
    """PyTorch SDPA with ``backend`` forced (or "default"); direction "forward" or "fwd+bwd"."""

    def __init__(self, ws: Workspace, direction: str, backend: str, launch: str = "cuda-graph"):
        if backend not in SDPA_BACKENDS or direction == "backward" or ws.case.bias:
            raise ValueError(f"SDPA backend {backend!r}, direction {direction!r}, bias {ws.case.bias}")
        self.backend = backend
        self.impl = {"impl": "sdpa", "backend": backend}
        super().__init__(ws, direction, launch)
        self.dropout_p = ws.case.dropout_p

    def _forward(self):
        x = self.x
        grouped = dict(enable_gqa=True) if self.ws.case.grouped else {}  # K/V over fewer heads (torch >= 2.5)
        with _sdpa_context(self.backend):
            return torch.nn.functional.scaled_dot_product_attention(x["q"], x["k"], x["v"], dropout_p=self.dropout_p,
                                                                    scale=self.ws.case.scale, is_causal=self.ws.case.causal,
                                                                    **grouped)

    def check(self) -> NotedVerdict:
        self.dropout_p = 0.0
        try:
            verdict = self.ws.verdict(self.run(), dropout=False)
        finally:
            self.dropout_p = self.ws.case.dropout_p
        note = "checked with dropout 0 (SDPA's mask cannot be regenerated)"
        if self.x["q"].is_cuda:
            note += f"; timed call's kernels: {attention_kernel_names(self.run)}"
        return NotedVerdict(verdict, note)


class EagerVariant(_Base):
    """The unfused chain with ``torch.native_dropout``; checked with the mask it drew."""

    impl = {"impl": "eager"}

    def __init__(self, ws: Workspace, direction: str, launch: str = "cuda-graph"):
        if ws.case.bias:
            raise ValueError("the eager baseline takes no bias")
        super().__init__(ws, direction, launch)

    def _forward(self):
        x, case = self.x, self.ws.case
        k, v = _repeated(case, x["k"], x["v"])
        a = torch.softmax(_masked(torch.einsum("bhjp,bhkp->bhjk", x["q"], k) * case.scale, case.causal), dim=-1)
        dropped, self.mask = torch.native_dropout(a, case.dropout_p, True)
        return torch.einsum("bhjk,bhkp->bhjp", dropped, v)

    def check(self) -> NotedVerdict:
        results = self.run()
        keep, keep_scale = self.mask, 1.0 / (1.0 - self.ws.case.dropout_p)  # native_dropout's own scale
        expected = (self.ws._run_chain(torch.float64, keep, keep_scale),
                    self.ws._run_chain(self.ws.case.dtype, keep, keep_scale))
        return NotedVerdict(self.ws.verdict(results, expected=expected), "checked with the mask native_dropout drew")


def config_variants(ws: Workspace, options: tuple = DROPOUT_MASK_OPTIONS) -> list:
    """Every forward configuration of the fused kernels (``attention_configs``) per dropout-mask
    option of ``options`` (``DROPOUT_MASK_OPTIONS``: writing the mask or not; writing it needs key
    blocks of whole groups of Philox calls), and every backward configuration with one of them (the
    option among its knobs).  Without dropout the option changes no kernel (no mask to write or
    draw): the first only (Llama-1B on an H200 timed each configuration twice, 237.0 / 239.4 us,
    602.0 / 603.4)."""
    P = ws.case.P
    options = options if ws.case.dropout_p > 0.0 else options[:1]
    return ([FusedVariant(ws, "forward", forward=c, backward=dict(dropout_mask=option))
             for option in options for c in attention_configs(P, "forward") if option in mask_options(c["block_k"])]
            + [FusedVariant(ws, "backward", backward=c) for c in attention_configs(P, "backward")
               if c["dropout_mask"] in options])


def biased_variants(ranked: list, per_direction: int) -> list:
    """The ``per_direction`` fastest forward and backward variants of ``ranked`` (``Sweep.ranked``
    of ``config_variants``) again, with biases added to q, k, v (``AttentionCase.bias``): what the
    selection needs to price a bias add folded into the attention."""
    if not ranked:
        return []
    ws = ranked[0].ws
    biased = Workspace(replace(ws.case, bias=True), ws.device, ws.seed)
    chosen = []
    for direction in ("forward", "backward"):
        chosen += [v for v in ranked if v.direction == direction][:per_direction]
    return [FusedVariant(biased, v.direction, v.forward, v.backward or {"dropout_mask": v.dropout_mask}) for v in chosen]


def baseline_variants(ws: Workspace, directions=("forward", "fwd+bwd"), launches=LAUNCHES, backends=SDPA_BACKENDS) -> list:
    """SDPA per backend and the eager chain, per direction and launch mode."""
    return [variant for direction in directions for launch in launches
            for variant in [SdpaVariant(ws, direction, b, launch) for b in backends] + [EagerVariant(ws, direction, launch)]]
