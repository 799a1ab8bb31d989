"""Direct launches of compiled Triton kernels, without the JIT's per-call work.

``kernel[grid](*args, **kwargs)`` binds the arguments, computes their specialisation (types,
16-byte alignment of pointers, integers equal to 1 or divisible by 16) and looks the compiled
kernel up on every call: on a slow host that is ~100 us a launch, more than many kernels take.
``DirectLaunch`` makes the first launch of each specialisation through the JIT, keeps the compiled
kernel, and hands it later calls' arguments straight (the bound argument list: the positional
arguments, then the keyword ones in the kernel's parameter order).  Each call still computes the
cheap part of the specialisation key (pointer alignment, integer classes), so an argument that
would compile differently goes through the JIT again.  Under the interpreter, with a launch hook
set (profilers), or with a Triton whose compiled kernels cannot be called this way, every launch
goes through the JIT.  ``launch(kernel, grid, args, kwargs)`` keeps one ``DirectLaunch`` per
kernel, grid and keyword arguments, for callers that launch a kernel as ``kernel[grid](...)`` would:
the ``LAUNCHES_KEPT`` most recently used (a grid follows the sizes, and a layer called at many
sequence lengths made new ones for the process's life).

``recording()`` collects the launches made inside it (each one's ``DirectLaunch``, compiled kernel,
device and arguments), for a caller that repeats them later with new tensors through
``DirectLaunch.fire`` and skips everything else (``datamove.kernels.replay``).

``dry_launches()`` launches nothing: every launch made inside it through this module (a
``DirectLaunch``, ``launch``, or ``through_jit``, which the GEMM templates launch by) has its
arguments bound to the kernel's parameters and its grid held to CUDA's limits, and is listed; so a
plan's program runs its host side whole, on tensors of the meta device, without a GPU
(``datamove.runtime.runnable``).
"""
from __future__ import annotations

import inspect
from collections import OrderedDict
from contextlib import contextmanager

import torch

try:
    from triton import knobs as _knobs
except ImportError:  # Triton before 3.4: no launch hooks to honour
    _knobs = None


def _key(args) -> tuple:
    """The part of Triton's specialisation that can differ between calls of one signature (tensors:
    16-byte alignment and dtype; integers: equal to 1, divisible by 16, 32-bit; folded into one
    small int, as this runs on every launch)."""
    key = []
    for a in args:
        kind = type(a)
        if kind is int:
            key.append((a == 1) | (a % 16 == 0) << 1 | (-2**31 <= a < 2**31) << 2)
        elif kind is torch.Tensor or kind is torch.nn.Parameter or isinstance(a, torch.Tensor):
            key.append((a.data_ptr() % 16 == 0, a.dtype))
        else:
            key.append(None)
    return tuple(key)


def hooked() -> bool:
    """Whether a launch hook is set (a profiler's): Triton 3.9 holds hooks in chains, empty when none."""
    runtime = getattr(_knobs, "runtime", None)
    hooks = (runtime.launch_enter_hook, runtime.launch_exit_hook) if runtime is not None else ()
    return any(hook is not None and getattr(hook, "calls", True) for hook in hooks)


class DirectLaunch:
    """``kernel`` (a ``triton.jit`` function) on a fixed ``grid`` with fixed keyword arguments
    (constexprs and launch options such as ``num_warps``); ``__call__(args)`` launches it on the
    positional ``args`` on the current CUDA stream.  ``varying``: the positions of the arguments
    that may change between calls (the others are the same every call), default all."""

    def __init__(self, kernel, grid: tuple, kwargs: dict, varying: list[int] | None = None):
        self.kernel, self.kwargs, self.varying = kernel, kwargs, varying
        self.grid = tuple(grid) + (1,) * (3 - len(grid))
        self.names = [p.name for p in getattr(kernel, "params", ())]  # none under the interpreter
        self.tail = None  # the keyword parameters' values in parameter order, after the positional ones
        self.compiled: dict[tuple, object] = {}

    def __call__(self, args: list) -> None:
        if _DRY.active is not None:
            _DRY.active.check(self.kernel, self.grid, args, self.kwargs)
            return
        device = torch._C._cuda_getDevice() if torch.cuda.is_initialized() else -1  # the JIT compiles per current device
        key = (device, _key(args if self.varying is None else [args[i] for i in self.varying]))
        compiled = self.compiled.get(key)
        if compiled is None or hooked():
            compiled = self.kernel[self.grid](*args, **self.kwargs)
            if self._direct(compiled, args):
                self.compiled[key] = compiled
            if _RECORDING.active is not None:
                _RECORDING.active.complete = False  # a launch through the JIT: nothing to repeat directly
            return
        if _RECORDING.active is not None:
            _RECORDING.active.launches.append((self, compiled, device, list(args)))
        self.fire(compiled, device, args)

    def fire(self, compiled, device: int, args: list) -> None:
        """Launch ``compiled`` (one of this kernel's specialisations, found by ``__call__``) on ``args``
        on ``device``'s current stream, with no check that the arguments specialise to it."""
        compiled.run(*self.grid, torch._C._cuda_getCurrentRawStream(device), compiled.function,
                     compiled.packed_metadata, None, None, None, *args, *self.tail)

    def _direct(self, compiled, args: list) -> bool:
        """Whether later calls may launch ``compiled`` directly (and its bound argument tail set)."""
        if not all(hasattr(compiled, a) for a in ("run", "function", "packed_metadata")) or compiled.function is None:
            return False
        if self.tail is None:
            if not self.names or any(n not in self.kwargs for n in self.names[len(args):]):
                return False
            self.tail = [self.kwargs[n] for n in self.names[len(args):]]
        return True


class Recording:
    """The launches made while recording: ``launches`` [(DirectLaunch, compiled kernel, device,
    arguments)]; ``complete`` False where one went through the JIT instead (no compiled kernel to
    repeat it with)."""

    def __init__(self):
        self.launches: list[tuple] = []
        self.complete = True


class _During:
    """What a ``with`` block of this module puts in force (``recording``, ``dry_launches``): ``active``
    inside it, None outside; not nested (``what`` names it in the refusal)."""

    def __init__(self, what: str):
        self.what, self.active = what, None

    @contextmanager
    def holding(self, value):
        if self.active is not None:
            raise RuntimeError(f"{self.what} already")
        self.active = value
        try:
            yield value
        finally:
            self.active = None


_RECORDING = _During("launches are being recorded")


def recording():
    """``with recording() as r``: r collects the direct launches made inside (not nested)."""
    return _RECORDING.holding(Recording())


GRID_LIMITS = (2**31 - 1, 65535, 65535)  # CUDA's largest grid, (x, y, z) programs


class SizeLimitError(ValueError):
    """Sizes too large for a kernel: its grid past ``GRID_LIMITS`` (``DryLaunches``), or an operand
    past what its int32 offsets reach (``check_offsets``)."""


def check_offsets(kernel: str, *tensors) -> None:
    """Refuse (``SizeLimitError``) operands of ``kernel`` (a GEMM template's, whose offsets are
    int32) holding 2**31 elements or more; None entries are skipped.  Called before the templates
    (``kernels.gemm``, ``kernels.gemm_join``), whose own check stays a plain ``ValueError``: their
    files' hash keys their timings, so they are not edited for a message."""
    if any(t is not None and t.numel() >= 2**31 for t in tensors):
        raise SizeLimitError(f"{kernel}: operands must hold fewer than 2**31 elements (int32 offsets)")


class DryLaunches:
    """The launches made inside ``dry_launches``: ``launches`` [(kernel name, (x, y, z) grid)], each
    checked by ``check`` and not launched."""

    def __init__(self):
        self.launches: list[tuple[str, tuple[int, int, int]]] = []

    def check(self, kernel, grid: tuple, args: list, kwargs: dict) -> None:
        """Refuse a launch of ``kernel`` on ``grid`` whose grid is not whole numbers within
        ``GRID_LIMITS`` (``SizeLimitError``) or whose ``args`` and ``kwargs`` (less launch options such as
        ``num_warps``) do not bind to its parameters (``TypeError``), both naming the kernel."""
        name = kernel.fn.__name__
        grid = tuple(grid) + (1,) * (3 - len(grid))
        if not all(isinstance(n, int) and 0 <= n <= limit for n, limit in zip(grid, GRID_LIMITS)):
            raise SizeLimitError(f"kernel {name}: grid {grid} is outside CUDA's limits {GRID_LIMITS}")
        parameters = set(kernel.arg_names)
        try:
            inspect.signature(kernel.fn).bind(*args, **{k: v for k, v in kwargs.items() if k in parameters})
        except TypeError as err:
            raise TypeError(f"kernel {name}: its arguments do not fit its parameters ({err})") from None
        self.launches.append((name, grid))


_DRY = _During("launches are dry")


def dry_launches():
    """``with dry_launches() as dry``: no kernel is launched inside; each launch is checked and
    listed in ``dry.launches`` instead (``DryLaunches``; not nested)."""
    return _DRY.holding(DryLaunches())


def through_jit(kernel, grid: tuple):
    """``kernel[grid]``: called with the kernel's arguments, it launches through Triton's JIT (which
    binds and specialises them on every call); inside ``dry_launches`` it checks them instead."""
    dry = _DRY.active
    if dry is None:
        return kernel[grid]
    return lambda *args, **kwargs: dry.check(kernel, grid, list(args), kwargs)


def ceil_div(a: int, b: int) -> int:
    """``triton.cdiv`` on the host without its per-call wrapper (~10 us a call in Triton 3.6-3.9)."""
    return -(-a // b)


LAUNCHES_KEPT = 1024  # ``launch``'s DirectLaunches kept, the least recently used let go
_LAUNCHES: OrderedDict[tuple, DirectLaunch] = OrderedDict()


def launch(kernel, grid: tuple, args: list, kwargs: dict) -> None:
    """``kernel[grid](*args, **kwargs)`` through a ``DirectLaunch`` kept per (kernel, grid, kwargs)
    (module doc): the kwargs (constexprs and launch options) must be hashable values."""
    key = (kernel, grid, *kwargs.items())
    direct = _LAUNCHES.get(key)
    if direct is None:
        direct = _LAUNCHES[key] = DirectLaunch(kernel, grid, kwargs)
        if len(_LAUNCHES) > LAUNCHES_KEPT:
            _LAUNCHES.popitem(last=False)
    else:
        _LAUNCHES.move_to_end(key)
    direct(args)
