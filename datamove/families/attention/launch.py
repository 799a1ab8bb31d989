"""The fused attention's steps at run time: the plan's ``ATTENTION_FORWARD`` and
``ATTENTION_BACKWARD`` steps as launchers of ``kernels.attention``, and the run-time check of a
constant its causal mask stands in for.

The launchers subclass ``datamove.kernels.launcher.Launcher`` (the store, ``Run``, ``Buffers``, the
recorded replay) rather than returning a launch object to a launcher of ``datamove.runtime.steps`` (as a
GEMM family's ``EpilogueLaunch`` does): an attention step is a step of its own, not a GEMM's, and
its launcher is all Triton kernels launched through ``kernels.launch``, so it takes the base's
replay as it is; ``datamove.kernels.launcher`` sits below both, so this module does not import
``datamove.runtime.steps`` and ``steps.build_launcher`` builds these from ``LAUNCHERS``
(``datamove.families.STEP_LAUNCHERS``).
"""
from __future__ import annotations

import torch

from datamove.dataflow.executor import dropout_offsets
from datamove.dataflow.initial_values import MASKED_SCORE
from datamove.kernels.attention import (attention_backward, attention_forward, dropout_grouped, dropout_strides_for,
                                        new_saved_mask)
from datamove.kernels.attention.library import cudnn_backward, cudnn_forward
from datamove.kernels.codegen import allocate
from datamove.kernels.launcher import Buffers, Launcher, Run, read, stored_alike
from datamove.layouts.plan import ATTENTION_BACKWARD, ATTENTION_FORWARD, Step
from datamove.layouts.step_config import AttentionConfig


class _AttentionLauncher(Launcher):
    """Shared by the attention's two passes: the roles' tensors as logical (b, h, rows, p) views;
    with a bias add folded in (config "bias": role -> (tensor before the add, bias); ``kernels.attention``:
    biases), the forward reads q, k, v before the add and q's and v's biases as logical (h, p)
    views, and writes the biased q (role q) for the backward, which reads it, k and v before the
    add, and v's bias.  With grouped-query attention (config "groups") k, v, dk and dv are over the
    K/V heads (their letter ``AttentionConfig.kv_heads``), G = ``group_size`` query heads each,
    passed to the kernels as ``groups``.

    With knobs ``{"impl": "cudnn"}`` the pass is cuDNN's (``kernels.attention.library``; the tuning
    measured it only where it takes the case: no dropout, no bias), which allocates its outputs:
    each is kept where it is stored as the plan lays it out, else copied into the planned buffer (a
    stacked group's member always is).  A call with a key-padding mask, or off a GPU (the Triton
    interpreter), runs the fused kernels' default configuration instead: cuDNN's statistics are
    theirs, so either pass of one may follow either of the other.  Not replayable: the recorded
    replay repeats Triton launches only."""

    replayable = True

    def __init__(self, step: Step, graph, buffers: Buffers):
        super().__init__(step, graph, buffers)
        config: AttentionConfig = step.config
        self.roles, letters = config.roles, config.letters
        self.scale, self.causal = config.scale, config.causal
        self.knobs = dict(config.knobs)
        self.library = self.knobs.pop("impl", None) == "cudnn"
        self.replayable = not self.library
        self._planned_strides: dict[str, tuple] = {}  # output -> its strides as the plan lays it out
        self.axes = {}  # role -> permutation of the tensor's spec-order dims into (b, h, rows, p)
        key_role = {"q": "rows", "k": "keys", "v": "keys", "o": "rows"}
        feature_role = {"q": "features", "k": "features", "v": "value_features", "o": "value_features"}
        for role in ("q", "k", "v", "o"):
            own = graph.tensors[self.roles[role]].letters
            heads = config.kv_heads if role in ("k", "v") else letters["heads"]
            wanted = [letters["batch"], heads, letters[key_role[role]], letters[feature_role[role]]]
            self.axes[role] = [own.index(x) for x in wanted]
        self.groups = config.group_size
        self.bias = config.bias
        self.bias_axes = {role: [graph.tensors[bias].letters.index(x) for x in (letters["heads"], letters[feature_role[role]])]
                          for role, (_, bias) in (self.bias or {}).items()}
        self.mask = self.roles.get("mask")
        self.dropout_p = graph.tensors[self.mask].p if self.mask else 0.0
        self.offset = dropout_offsets(graph)[self.mask] if self.mask else 0
        self.dropout_strides = None
        if self.mask:
            rename = {letters["batch"]: "b", letters["heads"]: "h", letters["rows"]: "j", letters["keys"]: "k"}
            order = "".join(rename[x] for x in graph.tensors[self.mask].letters)
            size = lambda role: graph.size(letters[role])  # noqa: E731
            self.dropout_strides = dropout_strides_for(order, size("batch"), size("heads"), size("rows"), size("keys"))
        self.lse = self.roles["lse"]

    def view(self, tensor: torch.Tensor, role: str) -> torch.Tensor:
        return tensor.permute(self.axes[role])

    def inputs(self, store: dict, roles=("q", "k", "v")) -> tuple:
        """The tensors of ``roles`` as logical views: before the bias add where one is folded in."""
        return tuple(self.view(read(self.step, store, self.bias[r][0] if self.bias else self.roles[r]), r) for r in roles)

    def bias_of(self, store: dict, role: str) -> torch.Tensor:
        """The bias added to ``role``'s tensor, as a logical (h, p) view."""
        return read(self.step, store, self.bias[role][1]).permute(self.bias_axes[role])

    def runs_library(self, run: Run, q: torch.Tensor) -> bool:
        """Whether this call runs cuDNN's pass (class doc)."""
        return self.library and run.key_padding_mask is None and q.is_cuda

    def placed(self, store: dict, name: str, role: str, result: torch.Tensor) -> torch.Tensor:
        """``result`` (a logical (b, h, rows, p) tensor cuDNN allocated) as output ``name`` of
        ``role`` in spec letter order: itself where its strides are the plan's, else copied into
        the planned buffer."""
        inverse = sorted(range(4), key=lambda n: self.axes[role][n])
        spec_order = result.permute(inverse)
        if name not in self.buffers.group_of:
            planned = self._planned_strides.get(name)
            if planned is None:
                meta = allocate(self.graph, name, self.step.writes[name], result.dtype, "meta")
                planned = self._planned_strides[name] = meta.stride()
            if stored_alike(spec_order, planned):
                return spec_order.as_strided(spec_order.shape, planned)  # a dim of size 1 may have any stride
        out = self.output(store, name)
        self.view(out, role).copy_(result)
        return out

    def common(self, run: Run) -> dict:
        return dict(scale=self.scale, dropout_p=self.dropout_p, seed=run.seed, offset=self.offset, causal=self.causal,
                    key_padding_mask=run.key_padding_mask, dropout_strides=self.dropout_strides, groups=self.groups)


class AttentionForwardLauncher(_AttentionLauncher):
    """``saves_mask``: the plan's backward reads the dropout mask this forward saves (knob
    ``dropout_mask`` "saved"); held only where the forward has one to save (``new_saved_mask``: a
    dropout whose layout the kernels draw sixteen keys a call), as elsewhere (evaluation mode, a
    shape whose rows do not start whole groups of counters) the backward draws the mask again."""

    def __init__(self, step: Step, graph, buffers: Buffers, saves_mask: bool):
        super().__init__(step, graph, buffers)
        self.saves_mask = saves_mask and self.dropout_p > 0 and dropout_grouped(self.dropout_strides, self.offset)

    def launch(self, store: dict, run: Run) -> None:
        r = self.roles
        q, k, v = self.inputs(store)
        if self.runs_library(run, q):
            o, lse = cudnn_forward(q, k, v, scale=self.scale, causal=self.causal)
            store[r["o"]], store[self.lse] = self.placed(store, r["o"], "o", o), lse
            return
        o = self.output(store, r["o"])
        saved = None
        if self.saves_mask:
            saved = new_saved_mask(q, k, dropout_p=self.dropout_p, offset=self.offset, dropout_strides=self.dropout_strides)
            store[saved_mask_name(self.lse)] = saved
        biased = {}
        if self.bias:
            store[r["q"]] = self.output(store, r["q"])
            biased = dict(bias=(self.bias_of(store, "q"), self.bias_of(store, "v")), q_biased=self.view(store[r["q"]], "q"))
        _, lse = attention_forward(q, k, v, o=self.view(o, "o"), saved_mask=saved, **biased, **self.common(run),
                                   **self.knobs)
        store[r["o"]], store[self.lse] = o, lse


class AttentionBackwardLauncher(_AttentionLauncher):
    def launch(self, store: dict, run: Run) -> None:
        r = self.roles
        q = self.view(read(self.step, store, r["q"]), "q")  # with a bias folded in, the forward's q + bq
        k, v = self.inputs(store, ("k", "v"))
        o = self.view(read(self.step, store, r["o"]), "o")
        do = self.view(read(self.step, store, r["do"]), "o")
        if self.runs_library(run, q):
            grads = cudnn_backward(do, q, k, v, o, store[self.lse], scale=self.scale, causal=self.causal)
            for role, grad in zip(("dq", "dk", "dv"), grads):
                store[r[role]] = self.placed(store, r[role], role[1], grad)
            return
        grads = {role: self.output(store, r[role]) for role in ("dq", "dk", "dv")}
        attention_backward(do, q, k, v, o, store[self.lse], saved_mask=store.get(saved_mask_name(self.lse)),
                           dq=self.view(grads["dq"], "q"), dk=self.view(grads["dk"], "k"), dv=self.view(grads["dv"], "v"),
                           v_bias=self.bias_of(store, "v") if self.bias else None, **self.common(run), **self.knobs)
        for role, tensor in grads.items():
            store[r[role]] = tensor


def saved_mask_name(lse: str) -> str:
    """Where the store holds the dropout decisions an attention forward saves for its backward."""
    return f"{lse}:mask"


def check_causal_constant(name: str, value: torch.Tensor) -> None:
    """Refuse a constant that the plan's fused attention replaces by its causal mask (GPT-2's
    additive ``causal``, ``dataflow.attention``'s check 10) unless it holds that mask: over
    (queries, keys), 0 where the key is at or before the query, ``MASKED_SCORE`` or less after
    (where exp underflows to 0 as for -inf)."""
    after = torch.ones(value.shape, dtype=torch.bool, device=value.device).triu(1)
    if not bool(torch.where(after, value <= MASKED_SCORE, value == 0).all()):
        raise ValueError(f"layer.{name} must hold the causal mask that this plan's fused attention applies "
                         f"in its place: 0 where the key is at or before the query, {MASKED_SCORE:g} or "
                         f"less after, e.g. layer.{name}.copy_(torch.triu(torch.full("
                         f"{tuple(value.shape)}, {MASKED_SCORE:g}), diagonal=1))")


LAUNCHERS = {  # plan step kind -> launcher factory (step, graph, buffers, saves_mask)
    ATTENTION_FORWARD: AttentionForwardLauncher,
    ATTENTION_BACKWARD: lambda step, graph, buffers, saves_mask: AttentionBackwardLauncher(step, graph, buffers),
}
