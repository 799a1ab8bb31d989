"""Compiling and launching generated operators: the source (``kernels.codegen.source``) written to
a cache directory keyed by its hash, imported with importlib and compiled by Triton;
``CompiledOperator`` binds it to a graph's dims and launches it (``compile_operator``)."""
from __future__ import annotations

import functools
import hashlib
import importlib.util
import os
import weakref
from pathlib import Path

import torch
import triton

from datamove.dataflow.dropout_mask import DECISION_GROUP
from datamove.kernels.codegen.part_plan import PartPlan, plan_part
from datamove.kernels.codegen.source import generate_source, kernel_name, part_knobs
from datamove.kernels.launch import DirectLaunch
from datamove.layouts.space import Configuration, parts

# The kernel adding up each program's column sums (``layouts.space.column_sums``;
# ``PartEmitter.sums_kernel``): columns per program, programs' sums per load (all of them, for up to
# 256 programs: one load per sum).  (Atomic adds of each program's sums into one row were wrong on an
# H100 with Triton 3.6 in most configurations; a last program to arrive adding everyone's sums left a
# serial tail: BERT-large's layernorm backward with its parameter gradients and the output bias
# gradient 31.4 us, against 18.7 for the layernorm backward alone; 32 columns and 64 programs a load: 9.9 us.)
SUM_COLUMNS, SUM_ROWS = 16, 256
CACHE_DIR = Path(os.environ.get("DATAMOVE_KERNEL_CACHE", Path.home() / ".cache" / "datamove" / "kernels"))
_modules: dict[str, object] = {}


def load_module(source: str):
    digest = hashlib.sha256(source.encode()).hexdigest()[:20]
    if digest in _modules:
        return _modules[digest], CACHE_DIR / f"op_{digest}.py"
    CACHE_DIR.mkdir(parents=True, exist_ok=True)
    path = CACHE_DIR / f"op_{digest}.py"
    if not path.exists() or path.read_text() != source:
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(source)
        os.replace(tmp, path)
    spec = importlib.util.spec_from_file_location(f"datamove_generated_op_{digest}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    _modules[digest] = module
    return module, path


def allocate(graph, tensor: str, layout: str, dtype=torch.float32, device="cpu") -> torch.Tensor:
    """An empty tensor stored in ``layout`` (order of its letters), returned as a view whose shape
    follows the tensor's spec-order letters."""
    letters = graph.tensors[tensor].letters
    shape, strides = _strided(letters, tuple(graph.dim_values[graph.letter_dims[l]] for l in letters), layout)
    return torch.empty_strided(shape, strides, dtype=dtype, device=device)


@functools.lru_cache(maxsize=4096)
def _strided(letters: str, sizes: tuple, layout: str) -> tuple[tuple, tuple]:
    """(shape in ``letters`` order, strides of dense storage in ``layout``) for ``allocate``."""
    size = dict(zip(letters, sizes))
    stride, strides = 1, {}
    for letter in reversed(layout):
        strides[letter] = stride
        stride *= size[letter]
    return sizes, tuple(strides[l] for l in letters)


class CompiledOperator:
    """A generated kernel bound to a graph's dims; ``source`` is its Triton text, ``path`` its file.

    ``run(tensors, seeds)``: ``tensors`` {input name -> tensor with shape in spec-order letters,
    any strides}; ``seeds`` {dropout mask -> (seed, offset)} for regenerated masks (seed: an
    integer or a one-element int64 tensor on the device holding it).  Returns
    {output name -> tensor of spec-order shape stored in its configured layout}, of the dtype of
    the first loaded floating input that is not a mask; or writes into ``outputs`` (the same
    names, any strides) when given.  Indices are int32 unless some offset,
    extent or dropout index can reach 2**31 (then an int64 variant is generated).  An operator
    of several parts (``layouts.space.parts``) is one launch: the parts' program ranges one
    after the other.
    """

    def __init__(self, graph, op, config: Configuration):
        self.graph, self.op, self.config = graph, op, config
        self.parts = parts(op)
        self.part_knobs = part_knobs(config, len(self.parts))
        self.plans = [plan_part(graph, part, knobs) for part, knobs in zip(self.parts, self.part_knobs)]
        self.plan = self.plans[0] if len(self.plans) == 1 else None  # the single part's plan
        self.loads = tuple(t for plan in self.plans for t in plan.loads)  # every tensor read from memory
        self._kernels: dict[bool, object] = {}
        self._scratch: dict[tuple, object] = {}  # (part, device[, "sums"]) -> mode "split" / column sums' buffers
        self._bound = [(kind, t) for plan in self.plans for kind, names in (("load", plan.loads), ("output", plan.outputs))
                       for t in names]  # each part's loads, then its outputs: the kernel's pointer order
        self._templates: dict[tuple, tuple] = {}  # (shapes and strides, device) -> ``_template``
        self.scalars = graph.scalars()  # the dim_<name> float arguments' values
        self.source, self.path = self._variant(False)[1:]

    def _variant(self, index64: bool):
        source = generate_source(self.graph, self.op, self.config, index64=index64)
        module, path = load_module(source)
        name = kernel_name(self.op)
        self._kernels[index64] = (getattr(module, f"{name}_kernel"), getattr(module, f"{name}_sums_kernel", None))
        return self._kernels[index64], source, path

    def _size(self, plan: PartPlan, letter: str) -> int:
        return self.graph.dim_values[plan.letters.dims[letter]]

    def _extent(self, plan: PartPlan, group: str) -> int:
        total = 1
        for letter in group:
            total *= self._size(plan, letter)
        return total

    def _programs(self, plan: PartPlan, knobs: dict) -> int:
        rows, cols = self._extent(plan, plan.rows), self._extent(plan, plan.cols)
        if plan.reduce_axis is None:
            return triton.cdiv(rows, knobs["block_row"]) * triton.cdiv(cols, knobs["block_col"])
        if plan.reduce_axis == 1:
            blocks = triton.cdiv(rows, knobs["block_row"])
            return min(blocks, knobs["programs"]) if plan.summed else blocks
        return self._extent(plan, plan.grid) * triton.cdiv(cols, knobs["block_col"]) * plan.split

    def _split_buffers(self, k: int, plan: PartPlan, knobs: dict, device) -> list:
        """Part ``k``'s scratch of mode "split" on ``device``: [partial sums, arrival counters], made
        once (the counters zeroed; the kernel leaves them zero), so a CUDA graph can replay them."""
        key = (k, str(device))
        if key not in self._scratch:
            blocks = self._programs(plan, knobs) // plan.split
            self._scratch[key] = [
                torch.empty(len(plan.reduced_outputs) * plan.split * blocks * knobs["block_col"], dtype=torch.float32,
                            device=device),
                torch.zeros(blocks, dtype=torch.int32, device=device)]
        return self._scratch[key]

    def _sums_buffer(self, k: int, plan: PartPlan, knobs: dict, device) -> torch.Tensor:
        """Part ``k``'s column sums of each program on ``device``, made once (each launch writes
        all of them before its sums kernel reads them), so a CUDA graph can replay them."""
        key = (k, str(device), "sums")
        if key not in self._scratch:
            self._scratch[key] = torch.empty(self._programs(plan, knobs) * len(plan.summed) * knobs["block_col"],
                                             dtype=torch.float32, device=device)
        return self._scratch[key]

    def grid(self) -> tuple[int]:
        return (sum(self._programs(plan, knobs) for plan, knobs in zip(self.plans, self.part_knobs)),)

    def run(self, tensors: dict, seeds: dict | None = None, outputs: dict | None = None) -> dict:
        if not outputs:
            loads = [tensors[t] for t in self.loads]
            reference = next((x for t, x in zip(self.loads, loads) if x.is_floating_point()
                              and self.graph.tensors[t].role != "dropout"), loads[0])
            outputs = {t: allocate(self.graph, t, self.config.layouts[t], reference.dtype, reference.device)
                       for plan in self.plans for t in plan.outputs}
        for launch, args in self._arguments(tensors, outputs, seeds or {}):
            launch(args)
        return outputs

    def _check_shapes(self, tensors: dict) -> None:
        for plan in self.plans:
            for t in plan.loads:
                expected = tuple(self._size(plan, l) for l in plan.letters.tensor_axes[t])
                if tuple(tensors[t].shape) != expected:
                    raise ValueError(f"{t}: shape {tuple(tensors[t].shape)} != {expected} "
                                     f"(spec order {plan.letters.tensor_axes[t]})")

    def warmup(self, dtype: torch.dtype, seeds: dict) -> None:
        """Compile for ``dtype`` inputs and outputs stored in the configured layouts, without
        running anything: fills Triton's on-disk cache with the kernels and their launchers (C
        modules Triton builds with the host compiler at a signature's first launch, 0.28 s each on
        an H200 host: most of a measuring process's build time when it made them, 2026-11-28), so
        that a later ``run`` in any process on the same GPU model only loads them
        (``harness.bench.Sweep`` compiles ahead in worker processes this way).  ``seeds`` as for
        ``run`` (their values take part in specialisation)."""
        stored = {t: allocate(self.graph, t, self.config.layouts.get(t, self.graph.tensors[t].letters), dtype, "meta")
                  for t in self.loads}
        outputs = {t: allocate(self.graph, t, self.config.layouts[t], dtype, "meta")
                   for plan in self.plans for t in plan.outputs}
        for launch, args in self._arguments(stored, outputs, seeds):
            compiled = launch.kernel.warmup(*(a.dtype if isinstance(a, torch.Tensor) else a for a in args),
                                            grid=launch.grid, **launch.kwargs)
            make_launcher = getattr(compiled, "_init_handles", None)  # Triton 3.x: launcher built, binary loaded
            if callable(make_launcher):
                make_launcher()

    def _arguments(self, tensors: dict, outputs: dict, seeds: dict) -> list[tuple]:
        """[(launcher, positional args)] of the launches on ``tensors`` -> ``outputs`` (the kernel,
        then for column sums the kernel adding them up): the arguments' template (``_template``)
        made once per tensors' shapes, strides and device, filled with this call's tensors and
        seeds (host time per launch counts where nothing is graphed)."""
        bound = [tensors[t] if kind == "load" else outputs[t] for kind, t in self._bound]
        key = (tuple((tuple(x.shape), x.stride()) for x in bound), bound[0].device)
        template = self._templates.get(key)
        if template is None:  # first call with these shapes and strides: checked here, once
            self._check_shapes(tensors)
            template = self._templates[key] = self._template(bound)
        launches, grouped = template
        for t in grouped:
            if seeds[t][1] % DECISION_GROUP:
                raise ValueError(f"dropout mask {t}: counter offset {seeds[t][1]} is not a multiple of {DECISION_GROUP}, "
                                 f"which drawing whole groups of Philox calls needs (dataflow.executor.dropout_offsets)")
        result = []
        for launch, slots in launches:
            args = []
            for kind, value in slots:
                if kind == _TENSOR:
                    args.append(bound[value])
                elif kind == _SEED:
                    seed = seeds[value][0]
                    args += [seed if isinstance(seed, torch.Tensor) else int(seed), int(seeds[value][1])]
                else:
                    args.append(value)
            result.append((launch, args))
        return result

    def _template(self, bound: list) -> tuple:
        """([(launcher, argument slots)], grouped masks) for tensors shaped and strided as ``bound``
        (``self._bound``'s order): a launcher is a ``kernels.launch.DirectLaunch`` of the kernel (then,
        for column sums, of the kernel adding them up) on its grid with its constexprs; a slot is
        (_TENSOR, index into ``bound``), (_SEED, mask: its seed and counter offset) or (_VALUE, the argument)."""
        reach, slots, ends, blocks, grouped, n = [], [], [], {}, [], 0
        for k, (plan, knobs) in enumerate(zip(self.plans, self.part_knobs)):
            axes = plan.letters.tensor_axes
            mine = bound[n:n + len(plan.loads) + len(plan.outputs)]
            reach += [sum((size - 1) * abs(stride) for size, stride in zip(x.shape, x.stride())) for x in mine]
            reach += [self._extent(plan, axes[t]) for t in plan.regenerated] + [self._extent(plan, plan.letters.letters)]
            slots += [(_TENSOR, n + i) for i in range(len(mine))]
            slots += [(_VALUE, stride) for x in mine for stride in x.stride()]
            n += len(mine)
            slots += [(_VALUE, self._size(plan, l)) for l in plan.letters.letters]
            slots += [(_VALUE, self.scalars[d]) for d in plan.dim_names]
            slots += [(_SEED, t) for t in plan.regenerated]
            grouped += [t for t in plan.regenerated if t in plan.grouped + plan.row_grouped + plan.row_calls]
            suffix = "" if len(self.plans) == 1 else f"_{k}"
            if plan.split > 1:
                slots += [(_VALUE, x) for x in self._split_buffers(k, plan, knobs, mine[0].device)]
                blocks[f"BLOCK_SPLIT{suffix}"] = plan.split
            if plan.summed:
                sums = self._sums_buffer(k, plan, knobs, mine[0].device)
                slots.append((_VALUE, sums))
                blocks[f"BLOCK_PROGRAMS{suffix}"] = self._programs(plan, knobs)
                outputs = [n - len(plan.outputs) + plan.outputs.index(t) for t in plan.summed]  # indices into bound
                finish = self._sums_slots(plan, knobs, sums, outputs, bound)
            blocks[f"BLOCK_ROW{suffix}"] = knobs["block_row"]
            blocks[f"BLOCK_COL{suffix}"] = knobs["block_col"]
            ends.append((ends[-1] if ends else 0) + self._programs(plan, knobs))
        if len(self.plans) > 1:
            slots += [(_VALUE, end) for end in ends[:-1]]
        index64 = max(reach) >= 2 ** 31 - 1
        kernel, sums_kernel = self._kernels.get(index64) or self._variant(index64)[0]
        varying, n = [], 0  # argument positions of the tensors and seeds (strides, sizes, scalars: the template's)
        for kind, _ in slots:
            width = 2 if kind == _SEED else 1
            varying += range(n, n + width) if kind in (_TENSOR, _SEED) else []
            n += width
        launches = [(DirectLaunch(kernel, (ends[-1],), {**blocks, "num_warps": self.config.knobs["num_warps"]}, varying),
                     slots)]
        if sums_kernel is not None:
            launches.append((DirectLaunch(sums_kernel, *finish[1:],
                                          [n for n, (kind, _) in enumerate(finish[0]) if kind == _TENSOR]), finish[0]))
        return launches, tuple(grouped)

    def _sums_slots(self, plan: PartPlan, knobs: dict, sums, outputs: list, bound: list) -> tuple:
        """(argument slots, grid, constexprs) of the kernel adding up the column sums ``sums`` into
        the outputs ``bound[i]`` for i in ``outputs``."""
        slots = [(_VALUE, sums)] + [(_TENSOR, i) for i in outputs]
        slots += [(_VALUE, stride) for i in outputs for stride in bound[i].stride()]
        slots += [(_VALUE, self._size(plan, l)) for l in plan.cols] + [(_VALUE, self._programs(plan, knobs))]
        grid = (triton.cdiv(self._extent(plan, plan.cols), SUM_COLUMNS),)
        return slots, grid, {"BLOCK_COL": knobs["block_col"], "SUM_ROWS": SUM_ROWS, "SUM_COLUMNS": SUM_COLUMNS,
                             "num_warps": 4}


_TENSOR, _SEED, _VALUE = "tensor", "seed", "value"  # kinds of CompiledOperator._template's argument slots
# kept while something holds them (a layer's program): one per operator and graph, and a layer makes a
# graph per call shape (they held their graph and scratch buffers for the process: datamove.runtime.module)
_compiled: "weakref.WeakValueDictionary[tuple, CompiledOperator]" = weakref.WeakValueDictionary()


def compile_operator(graph, op, config: Configuration) -> CompiledOperator:
    """Generate, cache and import the kernel of ``op`` under ``config`` at ``graph``'s dims (the same
    object while one is held; the kernel module itself is kept per source, ``load_module``)."""
    key = (id(graph), op.name, tuple(sorted(graph.dim_values.items())), config.key(),
           tuple(p.name for p in op.primitives))
    compiled = _compiled.get(key)
    if compiled is None:
        compiled = _compiled[key] = CompiledOperator(graph, op, config)
    return compiled
