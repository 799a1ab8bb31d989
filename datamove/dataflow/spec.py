"""Layer specs: a NumPy function with named-dim annotations, loaded with its dims.

A spec file declares its size dims with ``dims(B=8, L=512, ...)`` (symbols with defaults), maps
each index letter to a dim in ``INDEX`` (``{"b": B, "j": L, "k": L, ...}``), and defines one layer
function whose every argument is annotated ``Tensor("ibj")`` (stored in that letter order) or
``Dropout("hbjk", p)`` (a mask of 0 or 1/(1-p), p rounded to a multiple of 1/256 by ``dataflow.dropout_mask``, that datamove regenerates).  ``OPTIONS`` may list
choices for module constants (first value the default), set with ``--set NAME=VALUE``.  The layer
function is the one whose arguments are all annotated; a spec defining several names it with
``LAYER = "name"`` (or the function itself).

``INPUTS = ("x", "memory")`` may name the arguments that are data: the inputs the exported layer
is called with, ``layer(x, memory)`` in that order (or by name); every other argument with a
gradient is a learnable weight, held by the module.  Each name must be a ``Tensor`` argument with a
gradient (a ``requires_grad=False`` one is a constant, a module buffer).  Without ``INPUTS``, the
data are the first argument and the arguments sharing a batch or sequence letter with it
(``dataflow.layer_inputs``: right for an MLP, a normalization block, self- and cross-attention).
The spec's ``TORCH_ORDER`` gives the dim order of inputs and outputs in PyTorch; one it does not
list is taken in its spec letter order.
"""
from __future__ import annotations

import ast
import inspect
import sys
import types
from dataclasses import dataclass
from pathlib import Path

import dace


class SpecError(Exception):
    """A problem in the user's spec or dims; its message is meant to be printed as is."""


@dataclass(frozen=True)
class Tensor:
    """Annotation of a layer argument: a tensor stored in the order of ``letters``."""

    letters: str
    requires_grad: bool = True


@dataclass(frozen=True)
class Dropout:
    """Annotation of a dropout mask argument over ``letters`` with drop probability ``p``."""

    letters: str
    p: float = 0.1


def dims(**defaults: int) -> tuple[dace.symbol, ...]:
    """Declare size dims with their default values; returns one symbol per dim, in order."""
    symbols = []
    for name, value in defaults.items():
        symbol = dace.symbol(name)
        symbol.default = value
        symbols.append(symbol)
    return tuple(symbols)


@dataclass(frozen=True)
class Argument:
    """One layer argument: ``letters`` name its axes in storage order."""

    name: str
    letters: str
    kind: str  # "tensor" | "dropout"
    requires_grad: bool
    p: float = 0.0
    value: str = ""  # a constant the lowering made, with its known value (``dataflow.graph.TensorInfo.value``)


@dataclass
class LayerSpec:
    """A loaded spec: the layer function, its arguments, letter->dim map and dim values."""

    path: Path
    function: types.FunctionType
    arguments: list[Argument]
    letter_dims: dict[str, str]  # index letter -> dim name
    dim_values: dict[str, int]  # dim name -> size
    options: dict[str, str]
    output_names: list[str]
    inputs: tuple[str, ...] | None = None  # INPUTS: the data arguments, as declared; None: the default rule

    @property
    def module_prefix(self) -> str:
        """DaCe prefixes arrays of inlined helper functions with the module name."""
        return self.function.__module__

    @property
    def name(self) -> str:
        return self.function.__name__

    def letter_sizes(self) -> dict[str, int]:
        return {letter: self.dim_values[dim] for letter, dim in self.letter_dims.items()}


# NumPy constructs refused anywhere in a spec module, with the supported form (what the layer
# function itself may use is checked, and lowered, by ``dataflow.lowering``).
UNSUPPORTED_CALLS = {
    "random": "declare a Dropout(letters, p) argument and multiply by it",
    "softmax": "write the softmax out with np.max, np.exp, np.sum",
}
UNSUPPORTED_KEYWORDS = {
    "out": "assign the result to a name instead of out=",
    "where": "drop where= (masks are multiplications by a mask tensor)",
    "optimize": "drop optimize= (an einsum of three operands or more is contracted left to right, a GEMM a pair)",
}


def _check_source(path: Path, source: str) -> ast.Module:
    try:
        tree = ast.parse(source, filename=str(path))
    except SyntaxError as err:
        raise SpecError(f"{path}:{err.lineno}: syntax error: {err.msg}") from None
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            func = node.func
            chain = []
            while isinstance(func, ast.Attribute):
                chain.append(func.attr)
                func = func.value
            if isinstance(func, ast.Name) and func.id in ("np", "numpy"):
                for attr in chain:
                    if attr in UNSUPPORTED_CALLS:
                        raise SpecError(f"{path}:{node.lineno}: np.{'.'.join(reversed(chain))} is not supported: "
                                        f"{UNSUPPORTED_CALLS[attr]}")
            for keyword in node.keywords:
                if keyword.arg in UNSUPPORTED_KEYWORDS:
                    raise SpecError(f"{path}:{node.lineno}: keyword {keyword.arg}= is not supported: "
                                    f"{UNSUPPORTED_KEYWORDS[keyword.arg]}")
        if isinstance(node, (ast.For, ast.While)):
            raise SpecError(f"{path}:{node.lineno}: loops are not supported in a layer spec: "
                            "write the computation with whole-array NumPy expressions and np.einsum")
        name = _identifier(node)
        if name is not None and not name.isascii():
            raise SpecError(f"{path}:{node.lineno}: the name {name!r} is not ASCII: DaCe, which parses the layer, "
                            "reads ASCII names only: rename it with ASCII letters, digits and underscores")
    return tree


def _identifier(node: ast.AST) -> str | None:
    """The name ``node`` binds or reads (a variable, an argument, a function), None for other nodes."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.arg):
        return node.arg
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return node.name
    return None


def _read_source(path: Path) -> str:
    """The spec file's text; a binary file or another encoding than UTF-8 is refused."""
    data = path.read_bytes()
    bad_byte = data.find(0)  # NUL: valid UTF-8, but never in Python source
    try:
        source = data.decode("utf-8")
    except UnicodeDecodeError as err:
        bad_byte = err.start
    if bad_byte >= 0:
        raise SpecError(f"{path}: not a UTF-8 Python source file (byte {bad_byte}): give the spec's .py file, "
                        "e.g. configs/bert.py, saved as UTF-8 text")
    return source


def _import(path: Path, source: str) -> types.ModuleType:
    """The spec's module, under a name DaCe takes as part of an SDFG's name: ASCII letters, digits
    and underscores only (the file's stem with any other character an underscore: ``écoute.py``
    and ``my-bert.py`` were refused as invalid SDFG names); the hash of the path keeps it unique."""
    stem = "".join(c if c.isascii() and (c.isalnum() or c == "_") else "_" for c in path.stem)
    module_name = f"datamove_spec_{stem}_{abs(hash(path.resolve())) % 10**8}"
    module = types.ModuleType(module_name)
    module.__file__ = str(path)
    sys.modules[module_name] = module  # dace's parser looks functions' globals up through their module
    try:
        exec(compile(source, str(path), "exec", dont_inherit=True), module.__dict__)
    except SpecError:
        raise
    except (Exception, SystemExit) as err:  # the user's module-level code failed (or exited): say where
        tb = err.__traceback__
        lineno = None
        while tb is not None:
            if tb.tb_frame.f_code.co_filename == str(path):
                lineno = tb.tb_lineno
            tb = tb.tb_next
        where = f"{path}:{lineno}" if lineno else str(path)
        raise SpecError(f"{where}: error while loading the spec: {type(err).__name__}: {err}") from None
    return module


def _is_layer(function: types.FunctionType) -> bool:
    """Whether ``function`` can be a layer: it has arguments, each annotated ``Tensor`` or ``Dropout``."""
    params = inspect.signature(function).parameters.values()
    return bool(params) and all(isinstance(p.annotation, (Tensor, Dropout)) for p in params)


def _layer_function(path: Path, tree: ast.Module, module: types.ModuleType) -> types.FunctionType:
    """The spec's layer function: the one ``LAYER`` names (its name, or the function itself), else
    the one function whose arguments are all annotated."""
    functions = {name: value for name, value in vars(module).items()  # defined here, not aliases (LAYER = f)
                 if isinstance(value, types.FunctionType) and value.__module__ == module.__name__
                 and value.__name__ == name}
    candidates = [name for name, function in functions.items() if _is_layer(function)]
    if "LAYER" in vars(module):
        return _chosen_layer(path, tree, module.LAYER, functions, candidates)
    if len(candidates) == 1:
        return functions[candidates[0]]
    if not candidates:
        raise SpecError(f"{path}: no layer function found: looked for a function whose arguments are all "
                        "annotated Tensor(\"letters\") or Dropout(\"letters\", p)")
    raise SpecError(f"{path}: several layer functions ({', '.join(candidates)}): set LAYER = \"<the name of one of "
                    f"them>\", e.g. LAYER = \"{candidates[0]}\"")


def _chosen_layer(path: Path, tree: ast.Module, value, functions: dict, candidates: list[str]) -> types.FunctionType:
    """The layer function ``LAYER = value`` names (a function's name, or the function), refused in one
    line naming the spec's functions where it names none of its layer functions."""
    line = _assignment_line(tree, "LAYER")
    where = f"{path}:{line}" if line else str(path)
    others = [name for name in functions if name not in candidates]
    defined = (f"its layer functions (arguments all annotated Tensor or Dropout): {', '.join(candidates) or 'none'}"
               + (f"; its other functions: {', '.join(others)}" if others else ""))
    if isinstance(value, types.FunctionType) and functions.get(value.__name__) is value:
        name = value.__name__
    elif isinstance(value, str) and value in functions:
        name = value
    elif isinstance(value, str):
        raise SpecError(f"{where}: LAYER = {value!r}: {path.name} defines no function {value}; {defined}")
    else:
        raise SpecError(f"{where}: LAYER = {value!r}: expected the name of the layer function, e.g. "
                        f"LAYER = \"{(candidates or list(functions) or ['layer'])[0]}\"; {defined}")
    if name not in candidates:
        raise SpecError(f"{where}: LAYER = {name!r}: not a layer function: its arguments are not all annotated "
                        f"Tensor(\"letters\") or Dropout(\"letters\", p); {defined}")
    return functions[name]


def _assignment_line(tree: ast.Module, name: str) -> int | None:
    """The line of the spec's last module-level assignment to ``name`` (the one in force), None where
    there is none."""
    lines = [node.lineno for node in tree.body if isinstance(node, (ast.Assign, ast.AnnAssign))
             and any(isinstance(t, ast.Name) and t.id == name
                     for t in (node.targets if isinstance(node, ast.Assign) else [node.target]))]
    return lines[-1] if lines else None


def parse_assignments(text: str, what: str) -> dict[str, str]:
    """``"B=8,L=512"`` -> ``{"B": "8", "L": "512"}``; a name given twice with two values is an error."""
    result: dict[str, str] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, sep, value = item.partition("=")
        if not sep or not name.strip() or not value.strip():
            raise SpecError(f"{what}: expected NAME=VALUE, got {item!r}")
        name, value = name.strip(), value.strip()
        if name in result and result[name] != value:
            raise SpecError(f"{what}: contradictory values for {name}: {result[name]} and {value}")
        result[name] = value
    return result


def _resolve_dims(path: Path, module, overrides: dict[str, int]) -> tuple[dict[str, str], dict[str, int]]:
    index = getattr(module, "INDEX", None)
    if not isinstance(index, dict) or not index:
        raise SpecError(f"{path}: missing INDEX = {{letter: dim, ...}} mapping each index letter to a dim")
    letter_dims = {}
    for letter, dim in index.items():
        if not (isinstance(letter, str) and len(letter) == 1 and letter.isalpha()):
            raise SpecError(f"{path}: INDEX key {letter!r} is not a single letter")
        if not isinstance(dim, dace.symbol):
            own = letter.upper()
            raise SpecError(f"{path}: INDEX letter {letter!r} maps to {dim}, not a dim: each letter's size is a dim of "
                            f"dims(...) (a letter over {dim} needs a dim of its own, e.g. {own} in dims({own}=...), "
                            "with its size given by --dims)")
        letter_dims[letter] = str(dim)
    declared = {name: getattr(value, "default", None) for name, value in vars(module).items()
                if isinstance(value, dace.symbol)}
    values = {name: value for name, value in declared.items() if value is not None}
    unknown = sorted(set(overrides) - set(declared))
    if unknown:
        raise SpecError(f"--dims: unknown dims {', '.join(unknown)}; the spec declares {', '.join(sorted(declared))}")
    values.update(overrides)
    needed = sorted(set(letter_dims.values()))
    missing = [dim for dim in needed if dim not in values]
    bad = [f"{dim}={values[dim]}" for dim in needed if dim in values and not (isinstance(values[dim], int) and values[dim] > 0)]
    problems = []
    if missing:
        problems.append(f"missing dims: {', '.join(missing)} (give them with --dims {missing[0]}=...)")
    if bad:
        problems.append(f"dims must be positive integers: {', '.join(bad)}")
    if problems:
        raise SpecError(f"{path}: " + "; ".join(problems))
    return letter_dims, {dim: values[dim] for dim in needed}


def _return_names(path: Path, tree: ast.Module, function: types.FunctionType) -> list[str]:
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and node.name == function.__name__:
            returns = [n for n in ast.walk(node) if isinstance(n, ast.Return)]
            if len(returns) != 1 or returns[0].value is None:
                raise SpecError(f"{path}:{node.lineno}: the layer function must end with one return of its outputs")
            value = returns[0].value
            items = value.elts if isinstance(value, ast.Tuple) else [value]
            arguments = set(inspect.signature(function).parameters)
            names = [item.id if isinstance(item, ast.Name) else f"out{n}" for n, item in enumerate(items)]
            twice = next((name for name in names if names.count(name) > 1), None)
            if twice is not None:  # DaCe's parse stopped at KeyError: 'y'
                raise SpecError(f"{path}:{returns[0].lineno}: return {', '.join(map(ast.unparse, items))}: {twice} is returned twice; "
                                "return each output once")
            return [f"{name}_out" if name in arguments else name for name in names]  # x = x + ...; return x
    raise SpecError(f"{path}: cannot find the source of {function.__name__}")


def load_spec(path: str | Path, dim_overrides: dict[str, int] | None = None,
              options: dict[str, str] | None = None) -> LayerSpec:
    """Load a spec file as written (``dataflow.lowering.lowered_module.lower_spec`` then lowers its plain NumPy);
    ``dim_overrides`` replace its dim defaults, ``options`` its module constants."""
    path = Path(path)
    if path.is_dir():
        raise SpecError(f"{path}: a folder, not a spec file: give the spec's .py file, e.g. configs/bert.py")
    if not path.is_file():
        raise SpecError(f"{path}: no such spec file")
    source = _read_source(path)
    tree = _check_source(path, source)
    module = _import(path, source)
    chosen = _apply_options(path, tree, module, options or {})
    function = _layer_function(path, tree, module)
    letter_dims, dim_values = _resolve_dims(path, module, dim_overrides or {})
    arguments = []
    for param in inspect.signature(function).parameters.values():
        ann = param.annotation
        if not ann.letters:  # DaCe's parse stopped at "'NoneType' object has no attribute 'num_elements'"
            raise SpecError(f"{path}: argument {param.name}: {type(ann).__name__}({ann.letters!r}) names no axis; every "
                            "argument has at least one letter (a learned scale: give it the feature letter, a vector "
                            "as layer scale is)")
        unknown = sorted(set(ann.letters) - set(letter_dims))
        if unknown:
            raise SpecError(f"{path}: argument {param.name}: letters {', '.join(unknown)} are not in INDEX")
        if len(set(ann.letters)) != len(ann.letters):
            raise SpecError(f"{path}: argument {param.name}: repeated letter in {ann.letters!r}")
        if isinstance(ann, Dropout):
            if not 0.0 <= ann.p < 1.0:
                raise SpecError(f"{path}: argument {param.name}: dropout p={ann.p} must be in [0, 1)")
            arguments.append(Argument(param.name, ann.letters, "dropout", False, float(ann.p)))
        else:
            arguments.append(Argument(param.name, ann.letters, "tensor", ann.requires_grad))
    return LayerSpec(path, function, arguments, letter_dims, dim_values, chosen, _return_names(path, tree, function),
                     _declared_inputs(path, tree, module, function, arguments))


def _declared_inputs(path: Path, tree: ast.Module, module, function, arguments: list[Argument]) -> tuple[str, ...] | None:
    """The spec's ``INPUTS`` (see the module doc), checked against the layer's arguments; None if it has none."""
    if "INPUTS" not in vars(module):
        return None
    value = module.INPUTS
    line = _assignment_line(tree, "INPUTS")
    where = f"{path}:{line}" if line else str(path)
    if not isinstance(value, (tuple, list)) or not value or not all(isinstance(name, str) for name in value):
        raise SpecError(f"{where}: INPUTS = {value!r}: expected a tuple of the argument names the layer is called "
                        f"with, e.g. INPUTS = (\"{arguments[0].name}\",)")
    by_name = {arg.name: arg for arg in arguments}
    for name in value:
        arg = by_name.get(name)
        if arg is None:
            raise SpecError(f"{where}: INPUTS names {name!r}, which {function.__name__} does not have; its arguments "
                            f"are {', '.join(by_name)}")
        if arg.kind == "dropout":
            raise SpecError(f"{where}: INPUTS names {name!r}, a Dropout mask: datamove draws masks itself, "
                            "leave it out of INPUTS")
        if not arg.requires_grad:
            raise SpecError(f"{where}: INPUTS names {name!r}, declared Tensor({arg.letters!r}, requires_grad=False): "
                            f"an input the layer is called with takes a gradient (declare it Tensor({arg.letters!r})); "
                            "leave a constant out of INPUTS (the module holds it as a buffer)")
        if list(value).count(name) > 1:
            raise SpecError(f"{where}: INPUTS names {name!r} twice")
    return tuple(value)


def _apply_options(path: Path, tree: ast.Module, module, options: dict[str, str]) -> dict[str, str]:
    """Set each OPTIONS name's module constant (its name in capitals: activation -> ACTIVATION) to
    its ``--set`` value or its default, the first; the values chosen."""
    declared = getattr(module, "OPTIONS", {}) or {}
    chosen = {}
    for name, choices in declared.items():
        if not isinstance(choices, (tuple, list)) or not choices or not all(isinstance(c, str) for c in choices):
            raise SpecError(f"{path}: OPTIONS[{name!r}] is {choices!r}; expected a tuple of its values (strings), "
                            "the default first, e.g. OPTIONS = {\"activation\": (\"relu\", \"gelu\")}")
        if name.upper() not in vars(module):  # a constant spelt otherwise would keep its value whatever --set says
            line = _assignment_line(tree, "OPTIONS")
            raise SpecError(f"{path}:{line}: OPTIONS offers {name!r}, which sets the module constant {name.upper()}, "
                            f"and the spec defines no {name.upper()}: define {name.upper()} = {choices[0]!r} (the "
                            "default) and branch on it")
        value = options.get(name.lower(), choices[0])
        if value not in choices:
            raise SpecError(f"--set {name}={value}: choose one of {', '.join(choices)}")
        setattr(module, name.upper(), value)
        chosen[name] = value
    unknown = sorted(set(options) - {n.lower() for n in declared})
    if unknown:
        raise SpecError(f"--set: unknown options {', '.join(unknown)}; the spec offers "
                        f"{', '.join(declared) or 'none'}")
    return chosen
