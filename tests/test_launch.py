"""``kernels.launch.DirectLaunch`` against a recording stand-in of a Triton JIT function and its
compiled kernel (CPU: the real path needs a GPU; ``tests/test_graphs_gpu.py`` and the export
tests run it there)."""
from types import SimpleNamespace

import torch

from datamove.kernels.launch import DirectLaunch, launch


class Compiled:
    def __init__(self, log):
        self.log, self.function, self.packed_metadata = log, "fn", "meta"

    def run(self, *args):
        self.log.append(("direct", args))


class Jit:
    """A ``triton.jit`` function's interface: ``params``, ``kernel[grid](*args, **kwargs)`` -> compiled."""

    def __init__(self, names):
        self.params = [SimpleNamespace(name=n) for n in names]
        self.log = []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.log.append(("jit", grid, args, kwargs))
            return Compiled(self.log)
        return launch


def test_first_launch_through_the_jit_then_direct(monkeypatch):
    monkeypatch.setattr(torch._C, "_cuda_getDevice", lambda: 0, raising=False)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda device: 77, raising=False)
    jit = Jit(["x", "n", "BLOCK"])
    launch = DirectLaunch(jit, (5,), {"BLOCK": 64, "num_warps": 4})
    x = torch.zeros(64)
    launch([x, 32])
    assert jit.log[-1] == ("jit", (5, 1, 1), (x, 32), {"BLOCK": 64, "num_warps": 4})
    launch([x, 48])  # same specialisation (divisible by 16): straight to the compiled kernel, constexprs appended
    kind, args = jit.log[-1]
    assert kind == "direct" and args[:9] == (5, 1, 1, 77, "fn", "meta", None, None, None)
    assert args[9] is x and args[10:] == (48, 64)
    launch([x, 33])  # another specialisation: the JIT again
    assert jit.log[-1][0] == "jit"
    launch([x[1:], 48])  # a pointer no longer 16-byte aligned: the JIT again
    assert jit.log[-1][0] == "jit"
    launch([x.half(), 48])  # another dtype compiles another kernel: the JIT again
    assert jit.log[-1][0] == "jit"
    launch([x.half(), 48])
    assert jit.log[-1][0] == "direct"


def test_launch_keeps_one_direct_launch_per_kernel_grid_and_constexprs(monkeypatch):
    monkeypatch.setattr(torch._C, "_cuda_getDevice", lambda: 0, raising=False)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda device: 77, raising=False)
    jit = Jit(["x", "BLOCK"])
    x = torch.zeros(64)
    for _ in range(2):
        launch(jit, (3,), [x], {"BLOCK": 16})
    assert [entry[0] for entry in jit.log] == ["jit", "direct"]
    launch(jit, (3,), [x], {"BLOCK": 32})  # other constexprs: a kernel of its own
    launch(jit, (4,), [x], {"BLOCK": 16})  # another grid
    assert [entry[0] for entry in jit.log] == ["jit", "direct", "jit", "jit"]


def test_launch_keeps_the_most_recently_used_grids_only(monkeypatch):
    """A grid follows the sizes: a layer called at many sequence lengths made a ``DirectLaunch`` per
    length, kept for the process.  At most ``LAUNCHES_KEPT`` are kept, the least recently used let go
    (its next launch goes through the JIT again)."""
    from collections import OrderedDict

    import datamove.kernels.launch as launch_module

    monkeypatch.setattr(torch._C, "_cuda_getDevice", lambda: 0, raising=False)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda device: 77, raising=False)
    monkeypatch.setattr(launch_module, "_LAUNCHES", OrderedDict())
    monkeypatch.setattr(launch_module, "LAUNCHES_KEPT", 2)
    jit = Jit(["x", "BLOCK"])
    x = torch.zeros(64)
    for grid in (1, 2, 1, 3, 1, 2):  # 1 stays recent; 2 is let go when 3 comes
        launch(jit, (grid,), [x], {"BLOCK": 16})
    assert [entry[0] for entry in jit.log] == ["jit", "jit", "direct", "jit", "direct", "jit"]
    assert len(launch_module._LAUNCHES) == 2


def test_interpreted_kernels_always_go_through_the_jit():
    """Under the interpreter a launch returns no compiled kernel."""
    calls = []

    class Interpreted:
        params = [SimpleNamespace(name="x")]

        def __getitem__(self, grid):
            return lambda *args, **kwargs: calls.append(args)

    launch = DirectLaunch(Interpreted(), (2,), {})
    for _ in range(3):
        launch([torch.zeros(4)])
    assert len(calls) == 3
