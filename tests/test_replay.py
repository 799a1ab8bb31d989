"""Replayed launches (``datamove.kernels.replay``) against the checked launch path, on CPU.

The kernels are stand-ins that log their arguments (the real direct launch needs a GPU;
``tests/test_graphs_gpu.py`` compares the replayed layer's results with the checked path's there).
A replayed call must hand every kernel the arguments the checked path hands it: the same
integers and floats, and pointers that flow alike (each one the same input's, or the same tensor
made earlier in the call).
"""
from collections import OrderedDict
from types import SimpleNamespace

import pytest
import torch

import datamove.kernels.launch as launch_module
from datamove.runtime.layer import SEED_RANGE
from datamove.runtime.steps import Run
from plans import selected_plan
from test_export import BERT_DIMS, load, randomize, write

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="stand-in kernels on CPU")


class Compiled:
    function, packed_metadata = "fn", "meta"

    def __init__(self, log):
        self.log = log

    def run(self, *args):
        self.log.append(("direct", args[9:]))  # after the grid, stream, function, metadata and hooks


class LoggingJit:
    """A Triton kernel's interface (``params``, ``kernel[grid](*args, **kwargs)``) that runs nothing."""

    def __init__(self, kernel, log):
        names = getattr(kernel, "arg_names", None) or [p.name for p in kernel.params]
        self.params, self.log = [SimpleNamespace(name=n) for n in names], log

    def __getitem__(self, grid):
        def compile_and_launch(*args, **kwargs):
            self.log.append(("jit", args))
            return Compiled(self.log)
        return compile_and_launch


@pytest.fixture
def logged(monkeypatch):
    """Every direct launch made from here on through a ``LoggingJit``; returns the shared log."""
    log = []
    made = launch_module.DirectLaunch.__init__

    def init(self, kernel, *args, **kwargs):
        made(self, LoggingJit(kernel, log), *args, **kwargs)

    monkeypatch.setattr(launch_module.DirectLaunch, "__init__", init)
    monkeypatch.setattr(launch_module, "_LAUNCHES", OrderedDict())
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda device: 7, raising=False)
    return log


def canonical(log: list, given: list[torch.Tensor]) -> list[tuple]:
    """The logged launches with each pointer named by where it came from: ("given", i) for
    ``given[i]``'s, ("made", n) for the n-th other pointer seen in the call."""
    names = {t.data_ptr(): ("given", i) for i, t in enumerate(given) if t.numel()}
    result = []
    for kind, args in log:
        row = [kind]
        for a in args:
            if isinstance(a, torch.Tensor):
                row.append(names.setdefault(a.data_ptr(), ("made", len(names))))
            else:
                row.append(a)
        result.append(tuple(row))
    return result


@pytest.fixture(scope="module")
def bert(tmp_path_factory):
    return write(tmp_path_factory.mktemp("replay"), "bert", BERT_DIMS, selected_plan)


def test_replayed_calls_launch_what_the_checked_path_launches(bert, logged):
    layer = load(bert)
    randomize(layer, 3)
    program = layer.program(True)
    face = layer.interface
    x = torch.randn(program.torch_shapes[face.activations[0]])
    inputs = [x, *(layer.spec_view(t) for t in face.parameters + face.constants)]
    seed = torch.randint(0, SEED_RANGE, (1,))
    dy = torch.randn(program.torch_shapes[face.outputs[0]])
    launchers = program.forward_steps + program.backward_steps
    calls = []
    for _ in range(3):  # the first compiles (through the JIT), the second records, the third replays
        logged.clear()
        outputs, kept = program.call_forward(inputs, Run(seed))
        program.call_backward(inputs, kept, [dy], Run(seed))
        calls.append(canonical(logged, [*inputs, seed, dy]))
        if len(calls) == 2:
            assert all(launcher.replay is not None for launcher in launchers if launcher.replayable)
    print([r[:2] for r in calls[0]]); print([r[:2] for r in calls[1]])
    # the first call compiles each kernel through the JIT; a second layout change of the same grid
    # (one transpose kernel for both) finds it compiled
    changes = sum(launcher.step.kind == "layout_change" for launcher in launchers)
    assert sum(row[0] == "jit" for row in calls[0]) >= len(calls[0]) - max(changes - 1, 0)
    assert all(row[0] == "direct" for row in calls[1]) and len(calls[1]) == len(calls[0])
    assert any(launcher.replayable for launcher in launchers)
    assert calls[2] == calls[1]


def test_inputs_of_another_alignment_are_not_replayed(bert, logged):
    """A kernel compiled and recorded for 16-byte aligned pointers is not replayed on a misaligned
    input: the layer forgets its recordings and launches through the checked path (the JIT here)."""
    layer = load(bert)
    program = layer.program(True)
    face = layer.interface
    shape = program.torch_shapes[face.activations[0]]
    x = torch.randn(shape)
    rest = [layer.spec_view(t) for t in face.parameters + face.constants]
    seed = torch.randint(0, SEED_RANGE, (1,))
    for _ in range(3):
        program.call_forward([x, *rest], Run(seed))
    shifted = torch.empty(x.numel() + 1)[1:].view(shape).copy_(x)  # same strides, 4 bytes off
    logged.clear()
    program.call_forward([shifted, *rest], Run(seed))
    assert any(kind == "jit" for kind, _ in logged)
    logged.clear()
    program.call_forward([x, *rest], Run(seed))  # back to the aligned input: recorded anew, launched directly
    assert logged and all(kind == "direct" for kind, _ in logged)
