"""The lowering's state for one spec module (``SpecModule``): the spec's helper functions and
globals, the letter table, the helper versions lowered so far, the dims' names in the lowered module,
the constant arguments of known value made so far (``constant``), sizes evaluated at the spec's dims
or written over the graph's dims, and refusals with ``file:line``."""
from __future__ import annotations

import ast
import math

import dace
import numpy
import sympy

from datamove.dataflow.lowering.syntax import Letters, dim_symbol, float32_of, int_source, load_name, same_size
from datamove.dataflow.spec import Argument, LayerSpec, SpecError


class SpecModule:
    """Lowering state of one spec module: letters, helper specialisations, the constants made, the
    error format."""

    def __init__(self, spec: LayerSpec, source: str, tree: ast.Module, module_dict: dict):
        self.spec, self.source, self.globals = spec, source, module_dict
        self.functions = {node.name: node for node in tree.body if isinstance(node, ast.FunctionDef)}
        reserved = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and self.callee(node.func) == "np.einsum" and node.args \
                    and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str):
                reserved.update(c for c in node.args[0].value if c.isalpha())
        self.letters = Letters(spec, reserved)
        self.specialised: dict[str, list[tuple[tuple, str, ast.FunctionDef, object]]] = {}  # name -> versions
        self.dim_names: dict[str, str] = {}
        self.constants: dict[tuple[str, str], Argument] = {}  # (letters, value) -> the constant argument made
        self.names = set(module_dict) | {arg.name for arg in spec.arguments}  # what a constant argument must not
        # be named (nor what the layer function has assigned so far: ``constant``)
        self.root = None  # the layer function's lowering (its FunctionLowering), set by lower_spec

    # --- sizes and constants of known value ------------------------------------------------------

    def size_value(self, node: ast.AST, size) -> int:
        """``size`` at the spec's dims (a dim no letter has: its default)."""
        values = {dim: getattr(value, "default", None) for dim, value in self.globals.items()
                  if isinstance(value, dace.symbol)}
        values.update(self.spec.dim_values)
        result = sympy.sympify(size).subs({dim_symbol(d): v for d, v in values.items() if v is not None})
        if not result.is_Integer:
            raise self.error(node, f"size {size} is not an integer at the spec's dims")
        return int(result)

    def size_source(self, node: ast.AST, size) -> str:
        """``size`` as Python over the graph's dims (those of INDEX's letters)."""
        unknown = sorted(str(s) for s in sympy.sympify(size).free_symbols
                         if str(s) not in self.spec.dim_values)
        if unknown:
            raise self.error(node, f"size {size} uses {', '.join(unknown)}, which no letter of INDEX has",
                             "write it with the dims of INDEX")
        return int_source(size)

    def dim_of_size(self, node: ast.AST, size, what: str) -> str:
        """The dim (of INDEX's letters) that ``size`` is: equal as an expression, or with its floor
        divisions exact (``KV * (H // KV)``: H, also where H = KV), else the one of its value that
        ``size`` names, else the only one of its value."""
        dims = list(dict.fromkeys(self.spec.letter_dims.values()))
        exact = sympy.sympify(size).replace(sympy.floor, lambda a: a)  # KV * (H // KV) read as KV * H / KV = H
        for candidate in (size, exact):
            for dim in dims:
                if same_size(candidate, dim_symbol(dim)):
                    return dim
        value = self.size_value(node, size)
        equal = [dim for dim in dims if self.spec.dim_values[dim] == value]
        named = [dim for dim in equal if dim_symbol(dim) in sympy.sympify(size).free_symbols]
        if len(named) == 1 or len(equal) == 1:
            return (named or equal)[0]
        raise self.error(node, f"{what} has {size} = {value} elements: "
                         + (f"that is {' and '.join(equal)} at these dims, which one is meant is unclear" if equal
                            else "no dim of INDEX has that size"),
                         "write its size with the dim it is, e.g. np.repeat(k, H // KV, axis=1) for H heads")

    def constant(self, letters: tuple[str, ...], value: str, hint: str) -> str:
        """The name of the constant argument over ``letters`` of known ``value`` (made on first use)."""
        key = ("".join(letters), value)
        if key not in self.constants:
            taken = self.names | {a.name for a in self.constants.values()}
            if self.root is not None:
                taken |= self.root.written
            name, n = hint, 1
            while name in taken:
                n += 1
                name = f"{hint}_{n}"
            self.constants[key] = Argument(name, "".join(letters), "tensor", False, value=value)
        return self.constants[key].name

    def generated(self) -> set[str]:
        return {arg.name for arg in self.constants.values()}

    def error(self, node: ast.AST, problem: str, hint: str = "") -> SpecError:
        line = getattr(node, "lineno", None)
        where = f"{self.spec.path}:{line}" if line else str(self.spec.path)
        text = f"{where}: {_segment(self.source, node)}: {problem}"
        return SpecError(text + (f"; {hint}" if hint else ""))

    def callee(self, func: ast.expr) -> str | None:
        """``np.maximum.reduce`` -> "np.maximum.reduce" when ``np`` is NumPy in the module, "math.x" for math."""
        chain = []
        while isinstance(func, ast.Attribute):
            chain.append(func.attr)
            func = func.value
        if not isinstance(func, ast.Name) or not chain:
            return None
        value = self.globals.get(func.id)
        prefix = "np" if value is numpy else "math" if value is math else None
        return f"{prefix}.{'.'.join(reversed(chain))}" if prefix else None

    def dim_name(self, dim: str) -> str:
        """A global name bound to the dim's symbol in the lowered module."""
        if dim not in self.dim_names:
            value = self.globals.get(dim)
            name = dim if isinstance(value, dace.symbol) and str(value) == dim else f"_dim_{dim}"
            self.dim_names[dim] = name
        return self.dim_names[dim]

    def dims_of(self, letters) -> ast.expr:
        """``np.float32(D)`` or ``np.float32(D * H)`` for the product of the letters' dims."""
        expr = None
        for letter in letters:
            name = load_name(self.dim_name(self.letters.dim(letter)))
            expr = name if expr is None else ast.BinOp(expr, ast.Mult(), name)
        return float32_of(expr)


def _segment(source: str, node: ast.AST) -> str:
    text = ast.get_source_segment(source, node) or ast.unparse(node)
    text = " ".join(text.split())
    return text if len(text) <= 90 else text[:87] + "..."
