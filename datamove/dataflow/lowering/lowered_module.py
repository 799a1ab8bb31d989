"""``lower_spec``: a spec's layer function, and the helpers it calls, lowered and compiled into a new
module of their own (a copy of the spec's globals, each function with a source file of its own in
``linecache`` for DaCe's ``inspect``), the constants of known value made appended to the spec's
arguments; ``spec_line`` maps a line of that source back to the spec's."""
from __future__ import annotations

import ast
import copy
import linecache
import sys
import types
from dataclasses import replace

import dace
import numpy

from datamove.dataflow.lowering.spec_module import SpecModule
from datamove.dataflow.lowering.syntax import load_name, with_body
from datamove.dataflow.lowering.values import Arr
from datamove.dataflow.lowering.walker import FunctionLowering
from datamove.dataflow.spec import LayerSpec, SpecError

_LINES: dict[str, tuple[str, dict[int, int]]] = {}  # lowered source file -> (spec path, its line -> spec line)


def _compile(module: SpecModule, functions: list[ast.FunctionDef]) -> types.ModuleType:
    """The lowered functions in a new module (a copy of the spec's globals).  DaCe reads a function's
    source with ``inspect``, so each lowered function gets a source file of its own in ``linecache``."""
    name = f"{module.spec.function.__module__}_lowered"
    lowered = types.ModuleType(name)
    lowered.__dict__.update(module.globals)
    lowered.__dict__.update(__name__=name, np=numpy)
    for dim, alias in module.dim_names.items():
        if alias != dim:
            lowered.__dict__[alias] = dace.symbol(dim)
    sys.modules[name] = lowered  # dace's parser looks functions' globals up through their module
    for function in functions:
        text = ast.unparse(function) + "\n"
        filename = f"<lowered {module.spec.path}:{function.name}>"
        linecache.cache[filename] = (len(text), None, text.splitlines(True), filename)
        exec(compile(text, filename, "exec", dont_inherit=True), lowered.__dict__)  # noqa: S102
        ours = [n for n in ast.walk(function) if isinstance(n, ast.stmt)]
        theirs = [n for n in ast.walk(ast.parse(text).body[0]) if isinstance(n, ast.stmt)]
        _LINES[filename] = (str(module.spec.path), {new.lineno: getattr(old, "lineno", None)
                                                    for new, old in zip(theirs, ours)})
    return lowered


def spec_line(filename: str, line: int) -> tuple[str, int] | None:
    """The spec file and line behind a line of a lowered function's source (for DaCe's messages)."""
    path, lines = _LINES.get(filename, (None, {}))
    return (path, lines[line]) if lines.get(line) else None


def lower_spec(spec: LayerSpec) -> LayerSpec:
    """``spec`` (as ``dataflow.spec.load_spec`` reads it) with its layer function (and the helpers
    it calls) lowered to the dialect DaCe reads; ``spec`` itself if nothing needed lowering."""
    source = spec.path.read_text()
    module = SpecModule(spec, source, ast.parse(source, filename=str(spec.path)), spec.function.__globals__)
    node = module.functions.get(spec.function.__name__)
    if node is None:
        raise SpecError(f"{spec.path}: cannot find the source of {spec.function.__name__}")
    params = {arg.name: Arr.of(load_name(arg.name), arg.letters) for arg in spec.arguments}
    module.root = FunctionLowering(module, node, params)
    layer = with_body(node, module.root.lower_body(node.body))
    made = list(module.constants.values())  # constants of known value: arguments after the spec's
    if made:
        layer.args = copy.copy(node.args)
        layer.args.args = list(node.args.args) + [ast.arg(arg.name) for arg in made]
    functions = [f for versions in module.specialised.values() for _, _, f, _ in versions if f is not None]
    functions = list({f.name: f for f in functions}.values()) + [layer]
    if all(f.name in module.functions and ast.dump(f) == ast.dump(with_body(module.functions[f.name],
                                                                            module.functions[f.name].body))
           for f in functions):
        return spec
    lowered = _compile(module, functions)
    letter_dims = dict(spec.letter_dims)
    letter_dims.update({x: module.letters.dims[x] for arg in made for x in arg.letters})
    return replace(spec, function=lowered.__dict__[node.name], arguments=list(spec.arguments) + made,
                   letter_dims=letter_dims)
