"""The artifact of a tuned layer, and loading it as a PyTorch module.

``write_artifact(out_dir, ...)`` writes everything needed to rebuild the layer without DaCe and
without re-tuning:

- ``plan.json``: the ``layouts.plan.Plan``;
- ``graph.json``: the fused training graph (``dataflow.snapshot`` format);
- ``manifest.json``: spec name and hash, dims, dtype, the device the plan was timed on (name,
  compute capability; "cost model: <device>" where nothing was measured), library versions, and
  the layer's PyTorch interface (``inputs``: the data inputs it is called with, in order; the
  spec's ``TORCH_ORDER``, ``WEIGHTS``, ``POSITION_TABLES`` as ``position_tables``), the spec
  options it was built with (``options``, ``--set``),
  what the layer computes that a model is checked against (``hf_config``, ``module_config``: the
  spec's ``HF_CONFIG`` and ``MODULE_CONFIG``) with a hash of each (``config_hashes``: loading
  refuses a manifest whose tables were edited, as the layer would then pass models it does not
  compute as) and the plan's identity (``plan_id``: a hash of the plan files and ``graph.json``;
  loading refuses a folder whose files disagree with it, or with ``report.json``'s, as of
  different runs);
- ``kernels/<step>.py``: the generated Triton source of every generated step, for reading;
- with several tuned shapes (``optimize-layer --dims B=8,L=128|512``): the first shape's plan is
  ``plan.json``, every other one ``plans/<shape>.json`` (``B8-L512.json``, over ``graph.json`` at its
  dims) with its kernel sources in ``kernels/<shape>/``; the manifest's ``shapes`` lists them
  ({"dims": the call dims' sizes, "plan": file}), the first shape first.

Before anything is written, each plan's program is built and run forward and backward dry
(``datamove.runtime.runnable.check_runnable``): a plan that cannot run is refused
(``layouts.plan.PlanNotRunnable``, naming the step), a bug of the selection.

``load_layer(out_dir)`` returns a ``datamove.runtime.module.TunedLayer``.  Loading checks the manifest
against this machine: an artifact whose times were measured on another GPU model, or a dtype or
device the caller asks for that differs, is refused, naming both, unless ``allow_mismatch=True``
(the plan then runs as chosen, untuned for this device); a cost-model artifact loads anywhere
with a warning that nothing was measured.  A missing or damaged file of the artifact is refused,
naming it (``ArtifactError`` where it is not the JSON written, a manifest whose dims, dtype or
shapes disagree with the plans, whose shapes name a plan file that is not there, or whose
``hf_config`` or ``module_config`` is not the one written).  The layer runs at any batch size and
sequence length: a tuned shape's plan, or the nearest one at the call's sizes (``datamove.runtime.shapes``).

Weights: ``load_weights(layer, module)`` copies a PyTorch module's weights (a HF ``BertLayer``,
an ``nn.TransformerEncoderLayer`` with ``batch_first=True``, any module type the spec's
``WEIGHTS`` names; another is refused naming those) into the layer; ``state_dict_for(layer, kind)`` gives them back in that
module's format; ``replace_bert_layers(model, out_dir)`` swaps every ``BertLayer`` of a HF model
for a tuned layer carrying its weights.
"""
from __future__ import annotations

import hashlib
import json
import math
import warnings
from pathlib import Path

import torch

from datamove.dataflow.snapshot import load as load_graph
from datamove.dataflow.snapshot import snapshot
from datamove.dtypes import BF16, FP16
from datamove.families import epilogue_launch
from datamove.kernels.codegen import compile_operator
from datamove.layouts.plan import GEMM_EPILOGUE, GENERATED, Plan
from datamove.layouts.space import Configuration, generated_operators
from datamove.runtime.layer import tensor_interface
from datamove.runtime.module import TunedLayer
from datamove.runtime.runnable import check_runnable
from datamove.runtime.shapes import call_dims, check_plans, describe, file_stem
from datamove.runtime.weights import from_spec, to_spec
from datamove.runtime.weights import module_kind as kind_of

PLAN, GRAPH, MANIFEST, KERNELS, PLANS = "plan.json", "graph.json", "manifest.json", "kernels", "plans"
REPORT = "report.json"  # datamove.report's, beside the artifact in optimize-layer's output
MANIFEST_KEYS = ("dims", "dtype", "device", "torch_order", "weights")  # what loading and the benchmarks read
HASHED = ("hf_config", "module_config")  # manifest tables written with a hash of each (``config_hashes``)
REWRITE = "write the artifact again with optimize-layer SPEC --out DIR"


class ArtifactMismatch(RuntimeError):
    """An artifact tuned for another device, dtype or spec than the one asked for."""


class ArtifactError(ValueError):
    """A damaged artifact file: not JSON, or JSON that is not what the loader reads."""


def spec_hash(path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()[:16]


def _config_hash(value) -> str:
    """The hash of a manifest table (``HASHED``) as JSON gives it back (keys sorted)."""
    return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()[:16]


def _write(path: Path, text: str) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    tmp.replace(path)


def plan_identity(out_dir, plan_files) -> str:
    """The identity of an artifact's plan (``plan_id``): a hash of the text of its plan files
    (``plan_files``, relative to ``out_dir``, ``plan.json`` first) and of ``graph.json``."""
    digest = hashlib.sha256()
    for name in [*plan_files, GRAPH]:
        digest.update(name.encode() + b"\0" + (Path(out_dir) / name).read_bytes() + b"\0")
    return digest.hexdigest()[:16]


def write_artifact(out_dir, plan: Plan, graph, operators, *, spec_name: str, spec_digest: str,
                   torch_order: dict, weights: dict, device: dict, versions: dict, other_plans: tuple = (),
                   inputs: tuple[str, ...] | None = None, options: dict | None = None,
                   hf_config: dict | None = None, module_config: dict | None = None,
                   positions: tuple[str, ...] = ()) -> Path:
    """Write the artifact into ``out_dir``; ``device``: {"name", "capability", "measured"};
    ``options``: the spec options it was built with (``--set``), recorded in the manifest, as are
    ``hf_config`` (the spec's ``HF_CONFIG``: the HF config values the layer computes, which
    ``datamove.hf`` checks a model against) and ``module_config`` (the spec's ``MODULE_CONFIG``:
    per ``WEIGHTS`` kind, the module attributes the layer computes with, which ``load_weights``
    checks);
    ``plan``: the plan at ``graph``'s dims, ``other_plans``: those of the other tuned shapes
    (checked: ``datamove.runtime.shapes.check_plans``; and, before anything is written, that each
    one's program runs forward and backward: ``datamove.runtime.runnable.check_runnable``, else
    ``PlanNotRunnable``); ``inputs``: the spec's ``INPUTS`` (None: ``dataflow.layer_inputs``' default
    rule), written as the layer's data inputs (checked with ``torch_order`` against the graph);
    ``positions``: the spec's ``POSITION_TABLES`` (``runtime.call_constants``), written as
    ``position_tables``."""
    out = Path(out_dir)
    plans = [plan, *other_plans]
    interface = tensor_interface(graph, torch_order, inputs, positions)
    check_plans(plans, graph, interface)
    check_runnable(plans, graph, operators, interface)
    dims = call_dims(graph, interface)
    shapes = []
    for n, each in enumerate(plans):
        shape = {d: each.dims[d] for d in dims}
        stem = file_stem(shape)
        path, kernels = (out / PLAN, out / KERNELS) if n == 0 else (out / PLANS / f"{stem}.json", out / KERNELS / stem)
        path.parent.mkdir(parents=True, exist_ok=True)
        _write(path, each.dumps())
        _write_kernels(kernels, each, graph.with_dims({**graph.dim_values, **shape}), operators)
        shapes.append({"dims": shape, "plan": str(path.relative_to(out))})
    _write(out / GRAPH, json.dumps(snapshot(graph, operators), indent=1))
    manifest = {"spec": spec_name, "spec_hash": spec_digest, "dims": plan.dims, "dtype": plan.dtype.name,
                "device": device, "versions": versions, "inputs": list(interface.activations),
                "torch_order": torch_order, "position_tables": list(interface.positions),
                "weights": {kind: {t: list(v) for t, v in table.items()} for kind, table in weights.items()},
                "shapes": shapes, "options": dict(options or {}),
                # as read back: JSON's keys are strings, its arrays lists
                "hf_config": json.loads(json.dumps(dict(hf_config or {}))),
                "module_config": json.loads(json.dumps(dict(module_config or {}))),
                "plan_id": plan_identity(out, [shape["plan"] for shape in shapes])}
    manifest["config_hashes"] = {key: _config_hash(manifest[key]) for key in HASHED}
    _write(out / MANIFEST, json.dumps(manifest, indent=1))
    return out


def _write_kernels(folder: Path, plan: Plan, graph, operators) -> None:
    """The generated Triton source of every generated step of ``plan`` into ``folder``, and of the
    generated kernel a fused epilogue's step runs after its GEMM (its family's ``EpilogueLaunch.after``:
    a gradient epilogue's ``<consumer>_rest``)."""
    folder.mkdir(parents=True, exist_ok=True)
    ops = generated_operators(graph, operators)

    def write(step, op) -> None:
        config = Configuration({**step.reads, **step.writes, **step.config.masks}, step.config.knobs)
        _write(folder / f"{_file_name(op.name)}.py", compile_operator(graph, op, config).source)

    for step in plan.steps:
        if step.kind == GENERATED:
            write(step, ops[step.name])
        elif step.kind == GEMM_EPILOGUE and (after := epilogue_launch(step, graph, ops).after) is not None:
            write(*after)


def _file_name(step: str) -> str:
    return "".join(c if c.isalnum() or c in "_-" else "_" for c in step)


def _read_json(path: Path):
    """The JSON value in the artifact's file ``path``."""
    if not path.is_file():
        raise FileNotFoundError(f"{path}: missing: {REWRITE}")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except ValueError as err:  # not UTF-8, or not JSON
        raise ArtifactError(f"{path}: not valid JSON ({err}): {REWRITE}") from None


def _parsed(path: Path, parse):
    """``parse`` of the JSON in ``path``; JSON of another shape is a damaged file, named."""
    data = _read_json(path)
    try:
        return parse(data)
    except (KeyError, TypeError, ValueError, AttributeError) as err:
        raise ArtifactError(f"{path}: not a datamove {path.name} ({type(err).__name__}: {err}): {REWRITE}") from None


def read_manifest(out_dir) -> dict:
    path = Path(out_dir) / MANIFEST
    if not path.is_file():
        raise FileNotFoundError(f"{out_dir}: no {MANIFEST}: not a datamove artifact (write one with optimize-layer SPEC --out DIR)")
    manifest = _read_json(path)
    missing = [key for key in MANIFEST_KEYS if key not in manifest] if isinstance(manifest, dict) else MANIFEST_KEYS
    if missing:
        raise ArtifactError(f"{path}: not a datamove manifest (no {', '.join(missing)}): {REWRITE}")
    weights = manifest["weights"]
    shapes = {"dims": isinstance(manifest["dims"], dict), "dtype": isinstance(manifest["dtype"], str),
              "device": isinstance(manifest["device"], dict) and isinstance(manifest["device"].get("name"), str),
              "torch_order": isinstance(manifest["torch_order"], dict),
              "weights": isinstance(weights, dict) and all(
                  isinstance(table, dict) and all(isinstance(v, list) and len(v) == 3 for v in table.values())
                  for table in weights.values())}
    optional = {"hf_config": lambda v: isinstance(v, dict),  # absent in manifests written before they were
                "module_config": lambda v: isinstance(v, dict) and all(isinstance(t, dict) for t in v.values()),
                "config_hashes": lambda v: isinstance(v, dict) and all(isinstance(h, str) for h in v.values())}
    shapes.update({key: fine(manifest[key]) for key, fine in optional.items() if key in manifest})
    damaged = [key for key, fine in shapes.items() if not fine]
    if damaged:
        raise ArtifactError(f"{path}: not a datamove manifest (its {', '.join(damaged)} not as optimize-layer writes "
                            f"them): {REWRITE}")
    return manifest


def _check_identity(out: Path, manifest: dict, plan_files: list[str]) -> None:
    """The manifest's ``plan_id`` is that of the plan files and ``graph.json`` beside it, and
    ``report.json``'s (where it records one) too: the folder holds one run's output (``ArtifactError``
    otherwise).  An artifact written before manifests carried a ``plan_id`` is not checked."""
    recorded = manifest.get("plan_id")
    if recorded is None:
        return
    found = plan_identity(out, plan_files)
    if recorded != found:
        raise ArtifactError(f"{out}: {MANIFEST} is of another plan ({recorded}) than {', '.join(plan_files)} and "
                            f"{GRAPH} ({found}): the files come from different runs: {REWRITE}")
    try:
        report = json.loads((out / REPORT).read_text(encoding="utf-8"))["meta"].get("plan_id")
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return  # no report, or not one this check can read: the layer does not need it
    if report is not None and report != recorded:
        raise ArtifactError(f"{out}: {REPORT} is of another plan ({report}) than {MANIFEST} ({recorded}): "
                            f"the files come from different runs: {REWRITE}")


def _check_named_plans(out: Path, entries: list[dict]) -> None:
    """The manifest's ``shapes`` entries name plan files of the artifact, the first ``plan.json``, as
    ``write_artifact`` writes them: one naming another file, or a file that is not there (the
    manifest edited by hand, or the folder without it) is a damaged artifact (``ArtifactError``),
    refused naming it."""
    if entries[0]["plan"] != PLAN:
        raise ArtifactError(f"{out / MANIFEST}: its first shapes entry names the plan {entries[0]['plan']!r}, not "
                            f"{PLAN!r}: the manifest was edited: {REWRITE}")
    for entry in entries[1:]:
        named = Path(entry["plan"])
        if named.is_absolute() or ".." in named.parts:
            raise ArtifactError(f"{out / MANIFEST}: its shapes entry names the plan {entry['plan']!r}, outside the "
                                f"artifact's folder: the manifest was edited: {REWRITE}")
        if not (out / named).is_file():
            raise ArtifactError(f"{out / MANIFEST}: its shapes entry names the plan {entry['plan']!r}, which is missing "
                                f"({out / named}): the manifest was edited or the folder lost the file: {REWRITE}")


def _check_manifest_fits(out: Path, manifest: dict, plans: list[Plan], entries: list[dict]) -> None:
    """The manifest's ``dims`` and ``dtype`` are those of ``plan.json``, each ``shapes`` entry's
    ``dims`` those of its plan (``entries``, in the order of ``plans``) and its ``hf_config`` and
    ``module_config`` those written with them (their ``config_hashes``; a manifest written before
    it carried them is not checked so): the layer is built from the plans, and a model is checked
    against those tables, so a manifest saying otherwise (edited by hand, say) is damaged, refused
    naming the field (``ArtifactError``), not ignored."""
    plan = plans[0]
    wrong = []
    if manifest["dims"] != plan.dims:
        wrong.append(f"its dims ({describe(manifest['dims'])}) are not {PLAN}'s ({describe(plan.dims)})")
    if manifest["dtype"] != plan.dtype.name:
        wrong.append(f"its dtype ({manifest['dtype']!r}) is not {PLAN}'s ({plan.dtype.name!r})")
    for key, written in manifest.get("config_hashes", {}).items():
        if key in HASHED and (found := _config_hash(manifest.get(key, {}))) != written:
            wrong.append(f"its {key} is not the one written with the plan (its hash {found}, written {written})")
    for entry, each in zip(entries, plans):
        dims = entry.get("dims")
        if dims is not None and (not isinstance(dims, dict) or dims != {d: each.dims.get(d) for d in dims}):
            wrong.append(f"its shapes entry of {entry['plan']} has dims {dims!r}, the plan's are "
                         f"{describe(each.dims)}")
    if wrong:
        raise ArtifactError(f"{out / MANIFEST}: {'; '.join(wrong)}: the manifest was edited or is of another run: "
                            f"{REWRITE}")


def _current_device(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return device.type


def load_layer(out_dir, *, device=None, dtype: torch.dtype | None = None, allow_mismatch: bool = False,
               cuda_graphs: bool = True, backend: str | None = None) -> TunedLayer:
    """The tuned layer of an artifact (``write_artifact``), on ``device`` (default: CUDA if
    available, else CPU) in the plan's dtype.  ``backend``: ``"kernels"`` runs the plan's kernels
    (the default on CUDA), ``"torch"`` its computation in PyTorch operations (the default
    elsewhere: ``datamove.runtime.torch_program``).  ``cuda_graphs``: on CUDA, replay the layer's own CUDA
    graphs (``datamove.runtime.graphs``); False launches every kernel on every call."""
    out = Path(out_dir)
    manifest = read_manifest(out)
    plan = _parsed(out / PLAN, Plan.from_json)
    graph, operators = _parsed(out / GRAPH, load_graph)
    entries = manifest.get("shapes") or [{"plan": PLAN}]
    if not isinstance(entries, list) or not all(isinstance(e, dict) and isinstance(e.get("plan"), str) for e in entries):
        raise ArtifactError(f"{out / MANIFEST}: not a datamove manifest (its shapes are not a list of "
                            f"{{dims, plan}}): {REWRITE}")
    _check_named_plans(out, entries)
    plans = [plan] + [_parsed(out / entry["plan"], Plan.from_json) for entry in entries[1:]]
    _check_identity(out, manifest, [entry["plan"] for entry in entries])
    _check_manifest_fits(out, manifest, plans, entries)
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"load_layer(device={str(device)!r}): no CUDA GPU here (torch.cuda.is_available() is False); "
                         "leave device out, or give 'cpu'")
    if dtype is not None and dtype not in (torch.float32, torch.float64, torch.bfloat16, torch.float16):
        raise ValueError(f"load_layer(dtype={dtype!r}): expected torch.float32, torch.float64, torch.bfloat16 or "
                         "torch.float16 (or nothing: the plan's)")
    tuned_dtype = plan.dtype.torch
    problems = []
    if dtype is not None and dtype != tuned_dtype:
        tuned = {p.torch: p.short for p in (BF16, FP16)}  # what optimize-layer --dtype tunes
        problems.append(f"dtype {dtype} asked for, the plan was tuned for {tuned_dtype} ("
                        + (f"optimize-layer --dtype {tuned[dtype]} tunes one" if dtype in tuned else
                           f"no plan is tuned in {dtype}: allow_mismatch=True runs this one in it") + ")")
    timed_on = manifest["device"]
    here = _current_device(device)
    if timed_on.get("measured") and timed_on["name"] != here:
        problems.append(f"tuned on {timed_on['name']}, this is {here}")
    if problems and not allow_mismatch:
        raise ArtifactMismatch(f"{out}: " + "; ".join(problems) + ": run optimize-layer again on this machine "
                               "(re-tune), or load_layer(..., allow_mismatch=True) to run this plan untuned here")
    if not timed_on.get("measured"):
        warnings.warn(f"{out}: the plan's times are predicted by the cost model ({timed_on['name']}); nothing was "
                      "measured: run optimize-layer on the GPU to tune it", stacklevel=2)
    try:  # an artifact written before manifests named their inputs (or position tables): the default rule (none)
        interface = tensor_interface(graph, manifest["torch_order"], manifest.get("inputs"),
                                     manifest.get("position_tables", ()))
    except (TypeError, ValueError) as err:
        raise ArtifactError(f"{out / MANIFEST}: its interface does not fit {GRAPH} ({err}): {REWRITE}") from None
    try:
        check_plans(plans, graph, interface)
    except ValueError as err:
        raise ArtifactError(f"{out}: {err}: {REWRITE}") from None
    layer = TunedLayer(plan, graph, operators, interface, dtype or tuned_dtype, device, cuda_graphs, plans, backend)
    layer.weights_table = {kind: {t: tuple(v) for t, v in table.items()} for kind, table in manifest["weights"].items()}
    layer.hf_config, layer.module_config = manifest.get("hf_config", {}), manifest.get("module_config", {})
    return layer


def _kinds(layer: TunedLayer) -> str:
    """The module kinds the layer's spec gives weights for (its ``WEIGHTS``' keys), for messages."""
    return ", ".join(sorted(getattr(layer, "weights_table", {}))) or "none"


def _table(layer: TunedLayer, kind: str) -> dict:
    tables = getattr(layer, "weights_table", {})
    if kind not in tables:
        raise ValueError(f"the spec gives no weights for {kind!r}; its WEIGHTS name {_kinds(layer)}: ask for one of those")
    return tables[kind]


def module_kind(layer: TunedLayer, module: torch.nn.Module) -> str:
    """The spec's name (a ``WEIGHTS`` key) of ``module``'s type: the key ending in its class name
    and starting with its top-level package; a module of a kind the spec names none of is refused
    (``TypeError``), naming those it does."""
    top, name = type(module).__module__.split(".")[0], type(module).__name__
    for kind in getattr(layer, "weights_table", {}):
        if kind.split(".")[0] == top and kind.split(".")[-1] == name:
            return kind
    raise TypeError(f"load_weights: a {kind_of(module)} is not a module the tuned layer takes weights from: its spec's "
                    f"WEIGHTS name {_kinds(layer)}; give a module of one of those kinds, or add its kind to the spec's "
                    "WEIGHTS and run optimize-layer again")


def _check_layer(layer, caller: str) -> None:
    if not isinstance(layer, TunedLayer):
        raise TypeError(f"{caller}: the first argument is the tuned layer (load_layer's), not a "
                        f"{type(layer).__name__}")


def _sizes(layer: TunedLayer) -> dict[str, int]:
    return {letter: layer.graph.size(letter) for letter in layer.graph.letter_dims}


@torch.no_grad()
def load_weights(layer: TunedLayer, module: torch.nn.Module) -> TunedLayer:
    """Copy ``module``'s weights into ``layer`` (kinds in the spec's ``WEIGHTS``)."""
    _check_layer(layer, "load_weights")
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"load_weights: the second argument is the module whose weights to copy (a torch.nn.Module of a "
                        f"kind the spec's WEIGHTS name: {_kinds(layer)}), got {type(module).__name__}")
    kind = module_kind(layer, module)
    table, state = _table(layer, kind), module.state_dict()
    if any(t.is_meta for t in state.values()):
        raise ValueError(f"load_weights: the {type(module).__name__}'s weights are on the meta device (not made yet): "
                         "give a module holding its weights (e.g. after to_empty and load_state_dict)")
    read = {key for key, _, _ in table.values()}
    absent = sorted(read - set(state))
    if absent:
        raise ValueError(f"{type(module).__name__} has no {', '.join(absent)}, which the spec's WEIGHTS for {kind} "
                         "read: a module of another structure, or a damaged manifest")
    unread = sorted({name for name, _ in module.named_parameters()} - read)
    if unread:
        raise ValueError(f"{type(module).__name__}'s parameter(s) {', '.join(unread)} have no place in the spec "
                         f"(its WEIGHTS for {kind}): the tuned layer computes without them (biases the spec does "
                         "not add, say); use a model without them, or a spec that reads them")
    # a HF module's config (its attention's, say): what it computes, against what the layer computes;
    # not its dropout, which the caller's train() / eval() governs (replace_*_layers, for a model that
    # trains, checks that too)
    config = next((m.config for m in module.modules() if callable(getattr(getattr(m, "config", None), "to_dict", None))),
                  None)
    check_config(config, {key: value for key, value in getattr(layer, "hf_config", {}).items() if not _is_dropout(key)})
    attributes = {path: value for path, value in getattr(layer, "module_config", {}).get(kind, {}).items()
                  if not _is_dropout(path)}
    differing = _differing(lambda path, default: _attribute(module, path, default), attributes)
    if differing:
        raise ValueError(f"load_weights: the {type(module).__name__} computes otherwise than the tuned layer: "
                         f"{'; '.join(differing)}; use a module set as the spec (its MODULE_CONFIG for {kind}), or "
                         "change the spec and run optimize-layer again")
    for name, value in spec_values(layer, kind, state).items():
        layer.spec_view(name).copy_(value)
    return layer


def spec_values(layer: TunedLayer, kind: str, state: dict) -> dict[str, torch.Tensor]:
    """{parameter: its value over the spec's letters, in spec order (a view where it can)} read from
    ``state``, a ``kind`` module's state dict (the inverse of ``state_dict_for``); a value of another
    shape is refused naming its key and the fix."""
    sizes = _sizes(layer)
    values = {}
    for name, (key, pattern, index) in _table(layer, kind).items():
        try:
            values[name] = to_spec(state[key], pattern, index, layer.graph.tensors[name].letters, sizes)
        except ValueError as err:
            raise ValueError(f"{key}: {err}: the module is of other sizes than the tuned layer; run optimize-layer "
                             "with --dims at the module's sizes") from None
    return values


def _is_dropout(setting: str) -> bool:
    """Whether a config key or module attribute is a dropout rate (BERT's ``hidden_dropout_prob``,
    GPT-2's ``attn_pdrop``, ``nn.TransformerEncoderLayer``'s ``dropout.p``)."""
    return "dropout" in setting or setting.endswith("pdrop")


def check_config(config, computed: dict) -> bool:
    """Refuse a HF model whose ``config`` asks for something else than the tuned layer computes
    (``computed``: its spec's ``HF_CONFIG``, e.g. Llama's RMSNorm epsilon, activation, attention
    dropout, head counts; a list: values computing the same): the layer would run with the spec's
    values without a word.  Its dropout rates may all be 0 where the spec's are not (a model that
    trains without dropout): returns True then, the layer to train without dropout
    (``TunedLayer.dropout_off``); else False.  A spec without ``HF_CONFIG`` (``computed`` empty)
    checks nothing: warned once, as a model configured otherwise then computes silently otherwise
    than HF's."""
    if config is None:
        return False
    if not computed:
        warnings.warn("datamove: the tuned layer's spec declares no HF_CONFIG, so the model's config (norm epsilon, "
                      "activation, head counts, ...) is not checked against what the layer computes, and a model "
                      "configured otherwise runs with the spec's values: declare HF_CONFIG in the spec (as "
                      "configs/llama.py does) and run optimize-layer again")
        return False
    read = lambda key, default: getattr(config, key, default)  # noqa: E731
    rates = {key: value for key, value in computed.items() if _is_dropout(key)}
    dropout_off = bool(rates) and all(read(key, value) == 0 for key, value in rates.items()) \
        and any(value != 0 for value in rates.values())
    differing = _differing(read, computed if not dropout_off else
                           {key: value for key, value in computed.items() if key not in rates})
    if differing:
        more = (" (dropout rates: the spec's, or all 0 to train without dropout)"
                if any(_is_dropout(d.split("=")[0]) for d in differing) else "")
        raise ValueError(f"datamove: the model's config asks for what the tuned layer does not compute: "
                         f"{'; '.join(differing)}{more}; set those in the spec (its HF_CONFIG and what it computes) and "
                         "run optimize-layer again, or use a model configured as the spec")
    return dropout_off


AT_LEAST = "at least"  # a HF_CONFIG value {"at least": n}: any number n or above (a sliding window covering T)


def _accepts(theirs, value) -> bool:
    """Whether a config's or module's value ``theirs`` computes as ``value`` of a spec's
    ``HF_CONFIG`` / ``MODULE_CONFIG`` (a float: within rounding; ``{"at least": n}``: a number >= n)."""
    if isinstance(value, dict) and AT_LEAST in value:
        return isinstance(theirs, (int, float)) and not isinstance(theirs, bool) and theirs >= value[AT_LEAST]
    if isinstance(value, float) and isinstance(theirs, (int, float)):
        return math.isclose(theirs, value, rel_tol=1e-9, abs_tol=0.0)
    return theirs == value


def _described(value) -> str:
    """A ``HF_CONFIG`` value as the refusals name it: its repr; a list with an ``{"at least": n}``
    in it as its members joined by "or" ("None or at least 16")."""
    if isinstance(value, dict) and AT_LEAST in value:
        return f"{AT_LEAST} {value[AT_LEAST]!r}"
    if isinstance(value, list) and any(isinstance(v, dict) and AT_LEAST in v for v in value):
        return " or ".join(_described(v) for v in value)
    return repr(value)


def _differing(read, computed: dict) -> list[str]:
    """``key=value (the tuned layer computes ...)`` for each of ``computed``'s keys whose value
    ``read(key, default)`` gives otherwise (a list in ``computed``: values computing the same; a key
    the module or config lacks passes: the model computes as the spec there)."""
    differing, absent = [], object()
    for key, value in computed.items():
        accepted = value if isinstance(value, list) else [value]
        theirs = read(key, absent)
        if theirs is not absent and not any(_accepts(theirs, v) for v in accepted):
            computes = _described(value) if len(accepted) > 1 else _described(accepted[0])
            differing.append(f"{key}={theirs!r} (the tuned layer computes {computes})")
    return differing


def _attribute(module: torch.nn.Module, path: str, default):
    """``module``'s attribute at a dotted ``path`` (``self_attn.num_heads``); ``default`` where absent."""
    value = module
    for name in path.split("."):
        if not hasattr(value, name):
            return default
        value = getattr(value, name)
    return value


@torch.no_grad()
def state_dict_for(layer: TunedLayer, kind: str) -> dict[str, torch.Tensor]:
    """The layer's weights as a ``kind`` module's state dict (keys and shapes of that module)."""
    _check_layer(layer, "state_dict_for")
    result: dict[str, torch.Tensor] = {}
    sizes = _sizes(layer)
    for name, (key, pattern, index) in _table(layer, kind).items():
        value = layer.spec_view(name).detach()
        result[key] = from_spec(value, pattern, index, layer.graph.tensors[name].letters, sizes, result.get(key))
    return result
