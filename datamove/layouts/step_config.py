"""What a plan's step runs, by kind: one frozen dataclass each, read and written as JSON.

``layouts.plan.Step.config`` holds one of these; ``to_json`` / ``from_json`` give the artifact's
form (``plan.json``), unchanged from when configurations were dicts, so artifacts written before
load.  Tensors are the fused training graph's names; a *layout* is an order of a tensor's letters.

- ``GeneratedConfig`` (``GENERATED``): one fused element-wise / normalization operator as the
  generated kernel of ``layouts.space.Configuration(reads | writes | masks, knobs)``.
- ``ContractionConfig`` (``GEMM`` and ``GEMM_EPILOGUE``): an einsum as one GEMM, cuBLAS or the
  Triton template, optionally adding a residual (``Residual``) or with a consumer in its epilogue
  (``EpilogueConfig``: bias, activation, dropout; ``GradientEpilogueConfig``: an activation's
  derivative and a bias gradient's sums).
- ``AttentionConfig`` (``ATTENTION_FORWARD`` / ``ATTENTION_BACKWARD``): the fused attention.
- ``LayoutChangeConfig`` (``LAYOUT_CHANGE``): a copy of a tensor into another layout.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields

GENERATED, GEMM, GEMM_EPILOGUE = "generated", "gemm", "gemm_epilogue"
ATTENTION_FORWARD, ATTENTION_BACKWARD, LAYOUT_CHANGE = "attention_forward", "attention_backward", "layout_change"


@dataclass(frozen=True)
class GeneratedConfig:
    """``knobs``: the generated kernel's (``layouts.space``); ``masks``: {dropout tensor -> layout}
    of the masks it regenerates (never stored); ``composed``: for an operator of independent parts
    priced from each part's own best (``candidates.CandidateBuilder.composed``), the warps its
    parts' bests ran at (the main job tunes it at each), else None."""

    knobs: dict
    masks: dict = field(default_factory=dict)
    composed: tuple[int, ...] | None = None

    def to_json(self) -> dict:
        data = {"knobs": self.knobs, "masks": self.masks}
        return data if self.composed is None else {**data, "composed": list(self.composed)}

    @classmethod
    def from_json(cls, data: dict) -> "GeneratedConfig":
        composed = data.get("composed")
        return cls(data["knobs"], data.get("masks", {}), tuple(composed) if composed is not None else None)


@dataclass(frozen=True)
class Residual:
    """A GEMM adding ``tensor`` to its product (cuBLASLt's beta 1, ``tensor`` stored as the output),
    which covers the ``consumer`` that added them and writes its ``output``."""

    consumer: str
    tensor: str
    output: str


EPILOGUE_CONFIGS: list[type] = []  # the epilogue configurations' classes, one per kernel family (``register_epilogue``)


def register_epilogue(cls: type) -> type:
    """Class decorator: ``cls`` (a frozen dataclass) is a ``ContractionConfig.epilogue`` kind, read back
    from JSON as the registered class whose field names the JSON object has (list values as tuples).
    A kernel family with a step configuration of its own registers it where it defines it
    (``datamove.families``)."""
    if any({f.name for f in fields(other)} == {f.name for f in fields(cls)} for other in EPILOGUE_CONFIGS):
        raise ValueError(f"{cls.__name__}: another epilogue configuration has the same fields")
    EPILOGUE_CONFIGS.append(cls)
    return cls


def _epilogue_from_json(data: dict):
    kind = next((c for c in EPILOGUE_CONFIGS if {f.name for f in fields(c)} == set(data)), None)
    if kind is None:
        raise ValueError(f"an epilogue configuration with fields {sorted(data)}: no kernel family registered "
                         f"one (import datamove.families)")
    return kind(**{k: tuple(v) if isinstance(v, list) else v for k, v in data.items()})


@register_epilogue
@dataclass(frozen=True)
class EpilogueConfig:
    """The GEMM's element-wise consumer in the Triton template's epilogue
    (``families.forward_epilogue.FusableEpilogue``): bias over ``bias_letters``, ``activation``
    ("none", "relu", "gelu"), dropout ``mask`` at probability ``p``; ``save``: which value is also
    stored (``saved``); ``produced``: the GEMM's own result tensor, ``output``: the consumer's."""

    consumer: str
    bias: str | None
    bias_letters: str
    activation: str
    mask: str | None
    p: float
    save: str | None
    produced: str
    output: str
    saved: str | None


@register_epilogue
@dataclass(frozen=True)
class GradientEpilogueConfig:
    """The product times an activation's ``gradient`` at ``factor`` and the bias gradient's sums over
    ``sum_letters`` into ``summed`` in the template (``families.gradient_epilogue.GradientEpilogue``);
    the consumer's other ``primitives`` not in the kernel (``rest``) run after it by their generated
    kernel in ``rest_layouts``."""

    consumer: str
    gradient: str
    factor: str
    produced: str
    output: str
    summed: str
    sum_letters: str
    primitives: tuple[str, ...]
    rest: tuple[str, ...]
    rest_layouts: dict


@dataclass(frozen=True)
class ContractionConfig:
    """``einsum`` ("phi,ibj->phbj") on ``operands`` {"a", "b", "out" -> [tensors]}: each operand one
    tensor, or a stacked contraction's members along the einsum's extra leading letter, in stack
    order; ``backend``: "cublas" or "triton"; ``gemm``: the template's ``kernels.gemm.GemmConfig``
    fields (None: its default); ``algorithm``: cuBLAS only, the n-th of cuBLASLt's heuristic's
    algorithms the tuning found fastest; ``residual`` or ``epilogue``: what the GEMM also does
    (a ``GEMM_EPILOGUE`` step has an epilogue)."""

    einsum: str
    backend: str
    operands: dict
    gemm: dict | None = None
    algorithm: int = 0
    residual: Residual | None = None
    epilogue: object | None = None  # a registered epilogue configuration (``register_epilogue``)

    def to_json(self) -> dict:
        data = {"einsum": self.einsum, "backend": self.backend, "gemm": self.gemm, "operands": self.operands}
        if self.algorithm:
            data["algorithm"] = self.algorithm
        if self.residual is not None:
            data["residual"] = asdict(self.residual)
        if self.epilogue is not None:
            data["epilogue"] = {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self.epilogue).items()}
        return data

    @classmethod
    def from_json(cls, data: dict) -> "ContractionConfig":
        epilogue = data.get("epilogue")
        if epilogue is not None:
            epilogue = _epilogue_from_json(epilogue)
        residual = data.get("residual")
        return cls(data["einsum"], data["backend"], data["operands"], data.get("gemm"), data.get("algorithm", 0),
                   Residual(**residual) if residual is not None else None, epilogue)


@dataclass(frozen=True)
class AttentionConfig:
    """Flash-style attention over the graph's tensors in ``roles`` {"q", "k", "v", "o", "mask",
    "lse"; the backward's also "do", "dq", "dk", "dv"} (``lse``: a tensor of the plan only, over
    letters batch, heads, rows; ``mask``: a dropout tensor or None); ``letters`` {"batch", "heads",
    "rows", "keys", "features", "value_features"} in q's naming; ``scale`` of the scores; ``causal``:
    the kernels apply a causal mask, in place of the constant ``causal_constant`` the spec adds
    (None: no such constant); ``bias`` {"q", "k", "v" -> [GEMM result, bias]}: the bias add before
    the attention folded in; ``knobs``: the kernels' launch knobs (``kernels.attention``).

    ``groups``: grouped-query attention (``families.attention.attention_repeats``), None without:
    {"letter": the K/V heads' letter in the K/V tensors' naming (which is q's but for it), "size":
    G, the query heads per K/V head, "repeated": {"k", "v" (, "dk", "dv") -> the tensor over the query heads that
    the repeat of K/V wrote (and its gradient)}}: the roles k and v are the K/V tensors before the
    repeat, dk and dv their gradients (the repeat's backward, the sum over each group, folded in),
    the repeat's operators covered by the step."""

    knobs: dict
    roles: dict
    letters: dict
    scale: float
    causal: bool = False
    causal_constant: str | None = None
    bias: dict | None = None
    groups: dict | None = None

    def to_json(self) -> dict:
        data = {"knobs": self.knobs, "roles": self.roles, "letters": self.letters, "scale": self.scale,
                "causal": self.causal}
        if self.causal_constant is not None:
            data["causal_constant"] = self.causal_constant
        if self.bias is not None:
            data["bias"] = self.bias
        if self.groups is not None:
            data["groups"] = self.groups
        return data

    @classmethod
    def from_json(cls, data: dict) -> "AttentionConfig":
        return cls(data["knobs"], data["roles"], data["letters"], float(data["scale"]), bool(data.get("causal", False)),
                   data.get("causal_constant"), data.get("bias"), data.get("groups"))

    @property
    def kv_heads(self) -> str:
        """The letter of K and V's heads (and dK, dV's), in their tensors' naming: q's heads letter
        but with grouped-query attention."""
        return self.groups["letter"] if self.groups else self.letters["heads"]

    @property
    def group_size(self) -> int:
        """Query heads per K/V head (1 without grouped-query attention)."""
        return int(self.groups["size"]) if self.groups else 1


@dataclass(frozen=True)
class LayoutChangeConfig:
    """``tensor`` copied from layout ``source`` into layout ``target`` (JSON: "from", "to")."""

    tensor: str
    source: str
    target: str

    def to_json(self) -> dict:
        return {"tensor": self.tensor, "from": self.source, "to": self.target}

    @classmethod
    def from_json(cls, data: dict) -> "LayoutChangeConfig":
        return cls(data["tensor"], data["from"], data["to"])


CONFIGS = {GENERATED: GeneratedConfig, GEMM: ContractionConfig, GEMM_EPILOGUE: ContractionConfig,
           ATTENTION_FORWARD: AttentionConfig, ATTENTION_BACKWARD: AttentionConfig, LAYOUT_CHANGE: LayoutChangeConfig}
StepConfig = GeneratedConfig | ContractionConfig | AttentionConfig | LayoutChangeConfig


def config_from_json(kind: str, data: dict) -> StepConfig:
    """The configuration of a step of ``kind`` from its JSON form."""
    if kind not in CONFIGS:
        raise ValueError(f"unknown step kind {kind!r}: expected one of {sorted(CONFIGS)}")
    return CONFIGS[kind].from_json(data)
