"""Expressions, one ``e_<node type>`` method each: names (arguments, module-level dims and numbers,
``G = H // KV``), numbers, tuples, unary and binary operators, comparisons, indexing (``None`` /
``np.newaxis``, ``...``, one slice ``a:b``, ``x.shape[k]``), attributes (``x.T``, ``x.ndim``,
``np.pi``, ``np.finfo(np.float32).min``), calls of NumPy functions and of array methods dispatched to
the mixins that lower them.  Python numbers, module-level float constants and dims (``D``,
``x.shape[-1]``) in arithmetic become ``np.float32(...)``, the spec's dtype; sizes (dims,
``x.shape[k]``, integers and ``+ - * //`` of these, ``H // KV`` at module level) stay symbolic where
they bound a slice or count a repeat.  ``x.T``, ``np.transpose``, ``np.swapaxes``, ``x.transpose``,
``x.swapaxes`` relabel letters, no copy."""
from __future__ import annotations

import ast
import math
import types
from dataclasses import replace

import dace
import numpy
import sympy

from datamove.dataflow.lowering.support import BINARY, HINTS, PART_HINT, REDUCERS, SUPPORTED, UNARY
from datamove.dataflow.lowering.syntax import (as_tuple, dim_symbol, float32_of, int_source, load_name, make_call,
                                               np_attr, substitute, sympy_size)
from datamove.dataflow.lowering.values import Arr, Compare, Const, Num, Part, Static, as_int


class Expressions:
    """Mixin of ``FunctionLowering``: one method per kind of expression, and array methods."""

    def expr(self, node: ast.expr):
        method = getattr(self, f"e_{type(node).__name__}", None)
        if method is None:
            raise self.m.error(node, f"{type(node).__name__} expressions are not supported",
                               "write it with " + SUPPORTED)
        return self.known(method(node))

    def e_Name(self, node: ast.Name):
        if node.id in self.env:
            return self.env[node.id]
        if node.id not in self.m.globals:
            raise self.m.error(node, f"unknown name {node.id}")
        value = self.m.globals[node.id]
        if isinstance(value, dace.symbol):
            return Num(float32_of(load_name(self.m.dim_name(str(value)))), size=dim_symbol(str(value)))
        if isinstance(value, (int, float, numpy.integer, numpy.floating)) and not isinstance(value, bool):
            number = value.item() if hasattr(value, "item") else value
            return Num(float32_of(ast.Constant(number)), number,
                       sympy_size(number) if isinstance(number, int) else None)
        if isinstance(value, sympy.Expr) and value.free_symbols \
                and all(isinstance(self.m.globals.get(str(x)), dace.symbol) for x in value.free_symbols):
            return self.size_num(node, sympy_size(value))  # G = H // KV at module level
        if isinstance(value, numpy.ndarray):
            raise self.m.error(node, "module-level arrays are not supported",
                               "declare it as a Tensor argument of the layer")
        return Static(value)

    def e_Constant(self, node: ast.Constant):
        if isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
            return Num(float32_of(node), node.value, sympy_size(node.value) if isinstance(node.value, int) else None)
        return Static(node.value)

    def size_num(self, node: ast.AST, size) -> Num:
        """A size as a number of the spec's dtype (``np.float32(E // 2)``)."""
        size = sympy.sympify(size)
        if size.is_Integer:
            return Num(float32_of(ast.Constant(int(size))), int(size), size)
        source = int_source(size)
        names = {str(x): self.m.dim_name(str(x)) for x in size.free_symbols}
        return Num(float32_of(ast.parse(substitute(source, names), mode="eval").body), None, size)

    def size_of(self, node: ast.expr):
        """The sympy size an expression is (a slice bound, a count)."""
        value = self.expr(node)
        if isinstance(value, Static) and isinstance(value.value, int) and not isinstance(value.value, bool):
            return sympy.Integer(value.value)
        if not isinstance(value, Num) or value.size is None:
            raise self.m.error(node, "expected a size here: an integer, a dim, x.shape[k] or + - * // of these")
        return value.size

    def e_Tuple(self, node: ast.Tuple):
        items = [self.expr(e) for e in node.elts]
        if not all(isinstance(i, (Static, Num)) for i in items):
            raise self.m.error(node, "tuples of arrays are only supported as the layer's return value")
        return Static(tuple(i.value if isinstance(i, Static) else as_int(i) for i in items))

    e_List = e_Tuple

    def e_UnaryOp(self, node: ast.UnaryOp):
        value = self.expr(node.operand)
        if isinstance(node.op, ast.UAdd):
            return value
        if isinstance(value, Part) and isinstance(node.op, ast.USub):
            return replace(value, scale=-value.scale)
        if isinstance(value, Const) and isinstance(node.op, (ast.USub, ast.Invert, ast.Not)):
            return self.const_elementwise(node, lambda a: ast.UnaryOp(ast.USub(), a) if isinstance(node.op, ast.USub)
                                          else ast.Compare(a, [ast.Eq()], [ast.Constant(0)]), [value])
        if not isinstance(node.op, ast.USub):
            raise self.m.error(node, "only unary minus is supported on arrays")
        if isinstance(value, Num) and value.value is not None \
                and isinstance(node.operand, (ast.Constant, ast.Name, ast.Attribute)):
            return Num(float32_of(ast.Constant(-value.value)), -value.value,
                       None if value.size is None else -value.size)
        if isinstance(value, Static) and isinstance(value.value, int):
            return Static(-value.value)
        if isinstance(value, Arr):
            return replace(value, expr=ast.UnaryOp(ast.USub(), value.expr))
        if isinstance(value, Num):  # -(WINDOW - 1): still a number, and a size where its operand is one
            return Num(ast.UnaryOp(ast.USub(), value.expr), None if value.value is None else -value.value,
                       None if value.size is None else -value.size)
        raise self.m.error(node, "unary minus of a non-number")

    def e_BinOp(self, node: ast.BinOp):
        if isinstance(node.op, ast.MatMult):
            return self.matmul(node, self.array(node.left), self.array(node.right))
        left, right = self.expr(node.left), self.expr(node.right)
        if isinstance(node.op, ast.Pow):
            return self.power(node, left, right)
        sizes = isinstance(left, Num) and isinstance(right, Num) and left.size is not None and right.size is not None
        if sizes and isinstance(node.op, ast.FloorDiv):
            return self.size_num(node, sympy.floor(left.size / right.size))
        if isinstance(node.op, (ast.BitAnd, ast.BitOr)) and any(isinstance(v, Const) for v in (left, right)):
            return self.const_elementwise(node, lambda a, b: ast.BinOp(a, node.op, b), [left, right])
        if not isinstance(node.op, (ast.Add, ast.Sub, ast.Mult, ast.Div)):
            raise self.m.error(node, f"operator {type(node.op).__name__} is not supported",
                               "use +, -, *, /, ** or @ (// of sizes, & and | of constant masks)")
        result = self.arith(node, node.op, left, right)
        if sizes and not isinstance(node.op, ast.Div):  # a size still: E - E // 2
            combine = {ast.Add: sympy.Add, ast.Sub: lambda a, b: a - b, ast.Mult: sympy.Mul}[type(node.op)]
            result = replace(result, size=combine(left.size, right.size))
        return result

    def e_Compare(self, node: ast.Compare):
        if len(node.ops) != 1:
            raise self.m.error(node, "chained comparisons are not supported", "compare two values")
        left, right = self.expr(node.left), self.expr(node.comparators[0])
        if any(isinstance(v, Const) for v in (left, right)) and all(isinstance(v, (Const, Num)) for v in (left, right)):
            return self.const_elementwise(node, lambda a, b: ast.Compare(a, [node.ops[0]], [b]), [left, right])
        return Compare(node, (left, right))

    def e_Subscript(self, node: ast.Subscript):
        if isinstance(node.value, ast.Attribute) and node.value.attr == "shape":
            value = self.expr(node.value.value)
            letters = value.base.letters if isinstance(value, Part) else value.letters if isinstance(value, Const) \
                else self.as_array(node.value.value, value).letters
            if isinstance(node.slice, ast.Slice):
                raise self.m.error(node, "a slice of a shape is not supported",
                                   "name each size: (x.shape[-2], x.shape[-1]), or the dims, (T, T)")
            axis = self.static_int(node.slice)
            if not -len(letters) <= axis < len(letters):
                raise self.m.error(node, f"axis {axis} is out of range for an array with {len(letters)} axes")
            if isinstance(value, Part) and axis % len(letters) == value.axis:
                return self.size_num(node, value.length)
            letter = letters[axis]
            if letter is None:
                return Num(float32_of(ast.Constant(1)), 1.0, sympy.Integer(1))
            return Num(self.m.dims_of([letter]), None, dim_symbol(self.m.letters.dim(letter)))
        value = self.expr(node.value)
        items = node.slice.elts if isinstance(node.slice, ast.Tuple) else [node.slice]
        kinds: list = []
        cut = None  # the slice a:b, as its position in kinds
        for item in items:
            if isinstance(item, ast.Slice) and item.lower is item.upper is item.step is None:
                kinds.append(":")
            elif (isinstance(item, ast.Constant) and item.value is None) or self.m.callee(item) == "np.newaxis":
                kinds.append(None)
            elif isinstance(item, ast.Constant) and item.value is Ellipsis:
                kinds.append("...")
            elif isinstance(item, ast.Slice) and item.step is None and cut is None:
                cut = item
                kinds.append(item)
            elif isinstance(item, ast.Slice):
                raise self.m.error(node, "a slice with a step, or slices of more than one axis, are not supported",
                                   "slice one axis into contiguous parts (x[..., :h], x[..., h:])")
            else:
                raise self.m.error(node, "indexing with a number or an array is not supported (slices a:b of one "
                                   "axis, None / np.newaxis and ... are)",
                                   "declare the part you need as its own Tensor argument")
        if isinstance(value, Part):
            raise self.m.error(node, "indexing a slice is not supported", PART_HINT)
        if isinstance(value, Const) and cut is not None:
            raise self.m.error(node, "slicing a constant array is not supported",
                               "build it at the size you need (np.ones((T, T)), np.arange(T))")
        rank = len(value.letters) if isinstance(value, Const) else len(self.as_array(node.value, value).visible)
        if kinds.count("...") > 1:
            raise self.m.error(node, "more than one ... in an index")
        used = sum(k is not None and k != "..." for k in kinds)
        if used > rank:
            raise self.m.error(node, f"too many indices for an array with {rank} axes")
        if "..." in kinds:
            at = kinds.index("...")
            kinds[at:at + 1] = [":"] * (rank - used)
        else:
            kinds += [":"] * (rank - used)
        if isinstance(value, Const):
            axes = iter(value.letters)
            return replace(value, letters=tuple(None if k is None else next(axes) for k in kinds))
        array = self.as_array(node.value, value)
        axes = iter(array.visible)
        viewed = Arr(array.expr, array.stored, tuple(None if k is None else next(axes) for k in kinds))
        if cut is None:
            return viewed
        return self.cut(node, viewed, kinds.index(cut), cut)

    def e_Attribute(self, node: ast.Attribute):
        name = self.m.callee(node)
        if name in ("np.pi", "np.e", "math.pi", "math.e", "np.inf", "math.inf"):
            return Num(float32_of(ast.Constant(getattr(math, node.attr))), getattr(math, node.attr))
        if isinstance(node.value, ast.Call) and self.m.callee(node.value.func) == "np.finfo" \
                and node.attr in ("min", "max", "eps", "tiny"):  # np.finfo(np.float32).min: HF's masked score
            number = float(getattr(numpy.finfo(numpy.float32), node.attr))
            return Num(float32_of(ast.Constant(number)), number)
        if name is not None:
            raise self.m.error(node, f"{name} is not supported here", "write it with " + SUPPORTED)
        if node.attr == "T":
            array = self.array(node.value)
            return replace(array, visible=tuple(reversed(array.visible)))
        if node.attr == "ndim":
            return Static(len(self.array(node.value).visible))
        raise self.m.error(node, f"attribute .{node.attr} is not supported", HINTS.get(node.attr, ""))

    def e_IfExp(self, node: ast.IfExp):
        raise self.m.error(node, "conditional expressions are not supported",
                           "for an element-wise choice write np.where(cond, a, b)")

    def e_Call(self, node: ast.Call):
        m = self.m
        name = m.callee(node.func)
        if name is None and isinstance(node.func, ast.Name):
            if node.func.id in m.functions and isinstance(m.globals.get(node.func.id), types.FunctionType):
                args = [self.expr(a) for a in node.args]
                keywords = {k.arg: self.expr(k.value) for k in node.keywords}
                return self.call_helper(node, node.func.id, (args, keywords))
            if node.func.id in ("abs", "float", "int"):
                value = self.expr(node.args[0])
                if node.func.id == "abs":
                    return self.unary(node, "abs", value)
                if node.func.id == "float" and isinstance(value, Static) and isinstance(value.value, str):
                    try:
                        number = float(value.value)  # float("-inf")
                    except ValueError:
                        raise m.error(node, f"float({value.value!r}) is not a number") from None
                    return Num(float32_of(ast.Constant(number)), number)
                return value
            raise m.error(node, f"call of {node.func.id} is not supported",
                          "call NumPy functions or helper functions defined in the spec")
        if name is None and isinstance(node.func, ast.Attribute):
            return self.method(node, node.func.attr, self.expr(node.func.value))
        if name is None:
            raise m.error(node, "this call is not supported", "write it with " + SUPPORTED)
        short = name.split(".", 1)[1]
        if name == "np.float32":
            value = self.expr(node.args[0])
            return value if isinstance(value, (Arr, Part, Const)) else Num(node, value.value if isinstance(value, Num) else None)
        if name == "np.concatenate":
            return self.concatenate(node)
        if short == "repeat":
            return self.repeat(node, self.expr(node.args[0]), node.args[1:])
        if short in ("arange", "ones", "zeros", "full", "tril", "triu"):
            return self.constant_array(node, short)
        if short in HINTS or short.split(".")[0] in HINTS:
            raise m.error(node, f"{name} is not supported", HINTS.get(short, HINTS.get(short.split(".")[0])))
        if name == "np.einsum":
            return self.einsum(node)
        if short in ("matmul", "dot", "tensordot", "inner"):
            args = [self.array(a) for a in node.args[:2]]
            if short == "matmul":
                return self.matmul(node, *args)
            if short == "dot":
                return self.dot(node, *args)
            if short == "tensordot":
                axes = node.args[2] if len(node.args) > 2 else self.keyword(node, "axes")
                return self.tensordot(node, *args, 2 if axes is None else self.static(axes))
        if short in REDUCERS:
            array = self.array(node.args[0])
            axis = node.args[1] if len(node.args) > 1 else self.keyword(node, "axis")
            return self.reduce(node, REDUCERS[short], array, axis)
        if short in ("transpose", "swapaxes"):
            return self.method(node, short, self.expr(node.args[0]), node.args[1:])
        if short in UNARY or name in ("math.sqrt", "math.exp", "math.log", "math.tanh"):
            return self.unary(node, UNARY.get(short, short), self.expr(node.args[0]))
        if short in ("maximum", "minimum"):
            left, right = (self.expr(a) for a in node.args)
            return self.elementwise(node, lambda a, b: make_call(np_attr(short), a, b), [left, right])
        if short in BINARY:
            return self.arith(node, BINARY[short](), *(self.expr(a) for a in node.args))
        if short == "power":
            return self.power(node, *(self.expr(a) for a in node.args))
        if short == "square":
            return self.power(node, self.expr(node.args[0]), Num(ast.Constant(2), 2.0))
        if short == "reciprocal":
            return self.arith(node, ast.Div(), Num(float32_of(ast.Constant(1)), 1.0), self.expr(node.args[0]))
        if short == "negative":
            return self.arith(node, ast.Mult(), Num(float32_of(ast.Constant(-1)), -1.0), self.expr(node.args[0]))
        if short == "where":
            return self.where(node)
        if short == "clip":
            array = node.args[:1] + [k.value for k in node.keywords if k.arg == "a"]  # np.clip(x, ...) or np.clip(a=x, ...)
            if len(array) != 1:
                raise m.error(node, "np.clip " + ("without the array to clip" if not array else "given its array twice"),
                              "write np.clip(x, lo, hi), a bound None where there is none")
            return self.clip(node, self.expr(array[0]), node.args[1:], ("a_min", "min"), ("a_max", "max"), ("a",))
        raise m.error(node, f"{name} is not supported", "write it with " + SUPPORTED)

    def method(self, node: ast.Call, name: str, value, args=None):
        args = node.args if args is None else args
        m = self.m
        if isinstance(value, Const) and name == "astype":
            return value if not args or ast.unparse(args[0]) not in ("bool", "np.bool_") else \
                self.const_elementwise(node, lambda a: ast.Compare(a, [ast.NotEq()], [ast.Constant(0)]), [value])
        if name in HINTS:
            raise m.error(node, f".{name}() is not supported", HINTS[name])
        if name == "repeat":
            return self.repeat(node, value, args)
        if isinstance(value, Part):
            raise m.error(node, f".{name}() of a slice is not supported", PART_HINT)
        if isinstance(value, Const):
            value = self.materialise(node, value)
        if not isinstance(value, Arr):
            raise m.error(node, f".{name}() of a non-array is not supported")
        if name in REDUCERS and args is node.args:
            axis = args[0] if args else self.keyword(node, "axis")
            return self.reduce(node, REDUCERS[name], value, axis)
        if name == "transpose":
            axes_node = args[0] if len(args) == 1 else (ast.Tuple(list(args), ast.Load()) if args else
                                                         self.keyword(node, "axes"))
            if axes_node is None:
                return replace(value, visible=tuple(reversed(value.visible)))
            axes = [self.axis(node, a, len(value.visible)) for a in as_tuple(self.static(axes_node))]
            if sorted(axes) != list(range(len(value.visible))):
                raise m.error(node, f"axes {tuple(axes)} are not a permutation of the {len(value.visible)} axes")
            return replace(value, visible=tuple(value.visible[a] for a in axes))
        if name == "clip":
            return self.clip(node, value, args, ("min",), ("max",))
        if name == "swapaxes":
            a, b = (self.axis(node, self.static(x), len(value.visible)) for x in args[:2])
            visible = list(value.visible)
            visible[a], visible[b] = visible[b], visible[a]
            return replace(value, visible=tuple(visible))
        raise m.error(node, f".{name}() is not supported", "write it with " + SUPPORTED)
