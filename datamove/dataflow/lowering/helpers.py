"""Calls of helper functions defined in the spec.  A helper is lowered once per distinct argument
values (``SpecModule.specialised``; DaCe inlines the lowered function); one that contracts, or makes
or returns a constant of known value or a slice, or is given one, is inlined into its caller instead
(its statements before the caller's, its names made unique)."""
from __future__ import annotations

import ast
import inspect
import types
from dataclasses import replace

import numpy

from datamove.dataflow.lowering.syntax import float32_of, load_name, make_call, static_node, with_body
from datamove.dataflow.lowering.values import Arr, Const, NeedsInline, Num, Part, Static


class HelperCalls:
    """Mixin of ``FunctionLowering``: a call of a helper function of the spec."""

    def call_helper(self, call: ast.Call, name: str, args: tuple) -> object:
        """Lower helper ``name`` for these argument values; returns the value of the call.  An array
        passed as an expression is assigned to a name first (DaCe's inlining loses an einsum passed
        straight into a call).  A helper that contracts (its einsums' results would share names
        between calls once DaCe inlines them), or makes or returns a constant or a slice, or is given
        one, is inlined: its statements go before the caller's, its names made unique."""
        m = self.m
        node = m.functions[name]
        function = m.globals[name]
        try:
            bound = inspect.signature(function).bind(*args[0], **args[1])
        except TypeError as err:
            raise m.error(call, f"cannot call {name}: {err}") from None
        bound.apply_defaults()
        values = {}
        for param, value in bound.arguments.items():
            if not isinstance(value, (Arr, Num, Static, Part, Const)):
                value = _static_value(value)
            if isinstance(value, Arr) and not isinstance(value.expr, ast.Name):
                value = self.temp(param, value)
            elif isinstance(value, Part) and not isinstance(value.base.expr, ast.Name):
                value = replace(value, base=self.temp(param, value.base))
            values[param] = value
        if any(isinstance(v, (Part, Const)) for v in values.values()):
            return self.inline_helper(call, node, values)
        key = tuple((p, _signature(v)) for p, v in values.items())
        versions = m.specialised.setdefault(name, [])
        for known_key, known_name, lowered, returned in versions:
            if known_key == key:
                if lowered is None:
                    return self.inline_helper(call, node, values)
                return self.helper_value(call, known_name, values, returned)
        lowering = type(self)(m, node, {p: _as_param(p, v) for p, v in values.items()})  # a FunctionLowering
        try:
            lowered = with_body(node, lowering.lower_body(node.body))
            if any(isinstance(n, ast.Call) and ast.unparse(n.func) == "np.einsum" for n in ast.walk(lowered)):
                raise NeedsInline
        except NeedsInline:
            versions.append((key, name, None, None))
            return self.inline_helper(call, node, values)
        versions = [v for v in versions if v[2] is not None]
        same = next((n for _, n, f, _ in versions if ast.dump(with_body(f, f.body, name)) == ast.dump(lowered)), None)
        lowered.name = same or (name if not versions else f"{name}_{len(versions) + 1}")
        m.specialised[name].append((key, lowered.name, lowered, lowering.returned))
        return self.helper_value(call, lowered.name, values, lowering.returned)

    def inline_helper(self, call: ast.Call, node: ast.FunctionDef, values: dict) -> object:
        """Helper ``node``'s statements for these argument values, before this function's current
        statement; returns its value."""
        lowering = type(self)(self.m, node, values, parent=self)
        self.prelude.extend(lowering.lower_body(node.body))
        if lowering.returned is None:
            raise self.m.error(call, f"{node.name} returns nothing", "return its result")
        return lowering.returned

    def helper_value(self, call: ast.Call, name: str, values: dict, returned) -> object:
        """The call of the lowered helper ``name``, of the value it returns."""
        args = [value.expr if isinstance(value, (Arr, Num)) else static_node(value.value) for value in values.values()]
        expr = make_call(load_name(name), *args)
        ast.copy_location(expr, call)
        if isinstance(returned, Arr):
            return Arr(expr, returned.stored, returned.visible)
        if isinstance(returned, Num):
            return Num(expr, returned.value)
        raise self.m.error(call, "a helper must return one array or number",
                           "return a tuple from the layer function only")


def _signature(value) -> tuple:
    if isinstance(value, Arr):
        return ("array", value.stored, value.visible)
    if isinstance(value, Num):
        return ("number", value.value, str(value.size))
    return ("static", repr(value.value))


def _as_param(name: str, value):
    if isinstance(value, Arr):
        return Arr(load_name(name), value.stored, value.visible)
    if isinstance(value, Num):
        return Num(load_name(name), value.value, value.size)
    return value


def _static_value(value):
    if isinstance(value, bool) or value is None or isinstance(value, (str, tuple, list, types.ModuleType)):
        return Static(value)
    if isinstance(value, (int, float, numpy.floating, numpy.integer)):
        number = value.item() if hasattr(value, "item") else value
        return Num(float32_of(ast.Constant(number)), number)
    return Static(value)
