"""The walk over one function's statements (``FunctionLowering``): assignments (a name assigned again
gets a new array, so views of its old value stay valid; the same computation assigned twice is
computed once), the return (a layer function may return a tuple, a helper one value), ``if`` on
module constants (``OPTIONS``: the branch taken, the other kept for DaCe where it lowers), the
values statements hoist before the current one, and the value helpers every expression uses.  The
expressions themselves are lowered by the mixins ``FunctionLowering`` is made of."""
from __future__ import annotations

import ast
from dataclasses import replace

from datamove.dataflow.lowering.contractions import Contractions
from datamove.dataflow.lowering.elementwise import Elementwise
from datamove.dataflow.lowering.expressions import Expressions
from datamove.dataflow.lowering.helpers import HelperCalls
from datamove.dataflow.lowering.masks import KnownConstants
from datamove.dataflow.lowering.reductions import Reductions
from datamove.dataflow.lowering.repeat import Repeats
from datamove.dataflow.lowering.slices import Slices
from datamove.dataflow.lowering.spec_module import SpecModule
from datamove.dataflow.lowering.support import HINTS, PART_HINT
from datamove.dataflow.lowering.syntax import axes_text, load_name, static_node
from datamove.dataflow.lowering.values import Arr, Compare, Const, NeedsInline, Num, Part, Static
from datamove.dataflow.spec import SpecError


class FunctionLowering(Expressions, Elementwise, Reductions, Contractions, Slices, Repeats, KnownConstants,
                       HelperCalls):
    """Lowers one function body for given argument values (abstract interpretation, statement by statement)."""

    def __init__(self, module: SpecModule, node: ast.FunctionDef, params: dict,
                 parent: "FunctionLowering | None" = None):
        """``parent``: inline into that function (its names, its statements; ``params`` are its values)."""
        self.m = module
        self.env: dict[str, object] = dict(params)
        self.returned = None
        self.prelude: list[ast.stmt] = []
        self.target = "t"
        self.inline = parent is not None
        self.top: FunctionLowering = self if parent is None else parent.top  # the function the statements land in
        names = {n.id for n in ast.walk(node) if isinstance(n, ast.Name)} | set(params) | set(module.globals)
        if parent is None:
            self.taken = names
            self.written = set(params)  # array names assigned so far
            self.named: dict[str, str] = {}  # ast.dump of an assigned computation -> its name
        else:
            self.taken, self.written, self.named = parent.taken, parent.written, parent.named
            self.taken |= names
            self.target = parent.target

    # --- statements -------------------------------------------------------------------------

    def lower_body(self, body: list[ast.stmt]) -> list[ast.stmt]:
        out, saved = [], self.prelude
        for stmt in body:
            self.prelude = []
            lowered = self.statement(stmt)
            out += [new if getattr(new, "lineno", None) else ast.copy_location(new, stmt)  # inlined: the helper's line
                    for new in self.prelude + lowered]
        self.prelude = saved
        return out

    def statement(self, stmt: ast.stmt) -> list[ast.stmt]:
        m = self.m
        if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant):
            return [stmt]  # docstring
        if isinstance(stmt, ast.Pass):
            return [stmt]
        if isinstance(stmt, ast.AugAssign):
            target = ast.Name(stmt.target.id, ast.Load()) if isinstance(stmt.target, ast.Name) else None
            if target is None:
                raise m.error(stmt, "augmented assignment to a part of an array is not supported",
                              "assign a new name instead")
            value = ast.copy_location(ast.BinOp(target, stmt.op, stmt.value), stmt)
            stmt = ast.copy_location(ast.Assign([ast.Name(stmt.target.id, ast.Store())], value), stmt)
        if isinstance(stmt, ast.Assign):
            target = stmt.targets[0]
            pairs = [(target, stmt.value)]
            if isinstance(target, ast.Tuple) and isinstance(stmt.value, ast.Tuple) \
                    and len(target.elts) == len(stmt.value.elts):
                pairs = list(zip(target.elts, stmt.value.elts))  # q, k, v = a, b, c
            if len(stmt.targets) != 1 or not all(isinstance(t, ast.Name) for t, _ in pairs):
                split = stmt.value.func if isinstance(stmt.value, ast.Call) else None
                if isinstance(split, ast.Attribute) and split.attr in ("split", "array_split", "hsplit", "vsplit"):
                    raise m.error(stmt, f"np.{split.attr} is not supported", HINTS["split"])
                raise m.error(stmt, "only assignments to names are supported",
                              "assign each result to its own name (no slices, no unpacking of arrays)")
            values = []
            for name, value in pairs:
                self.target = name.id
                values.append(self.expr(value))
            return [new for (name, value), v in zip(pairs, values) for new in self.assign(stmt, name.id, value, v)]
        if isinstance(stmt, ast.Return):
            if stmt.value is None:
                raise m.error(stmt, "the function returns nothing", "return its outputs")
            items = stmt.value.elts if isinstance(stmt.value, ast.Tuple) else [stmt.value]
            if self.inline:
                if len(items) != 1:
                    raise m.error(stmt, "a helper must return one array or number",
                                  "return a tuple from the layer function only")
                self.returned = self.expr(items[0])
                return []
            values = []
            for item in items:
                self.target = item.id if isinstance(item, ast.Name) else "out"
                value = self.expr(item)
                if isinstance(value, (Part, Const)):
                    if self.top is not m.root:
                        raise NeedsInline
                    if isinstance(value, Part):
                        raise m.error(item, "returns a slice", PART_HINT)
                    value = self.materialise(item, value)
                if isinstance(value, Arr) and not value.plain:
                    raise m.error(item, f"returns a view with axes {axes_text(value.letters)} of an array stored as "
                                  f"{axes_text(value.stored)}", "return an array computed in the order of its "
                                  "axes (a transposed or keepdims view has no storage of its own)")
                values.append(value)
            if len(values) == 1:
                self.returned = values[0]
                return [ast.Return(self.render_value(values[0]))]
            self.returned = tuple(values)
            return [ast.Return(ast.Tuple([self.render_value(v) for v in values], ast.Load()))]
        if isinstance(stmt, ast.If):
            try:
                taken = bool(eval(compile(ast.Expression(stmt.test), "<test>", "eval"), dict(m.globals),  # noqa: S307
                                  {k: v.value for k, v in self.env.items() if isinstance(v, Static)}))
            except Exception:
                raise m.error(stmt.test, "a condition on array values is not supported",
                              "branch on module constants only (OPTIONS); for element-wise choices use "
                              "np.where(cond, a, b)") from None
            body, orelse = (stmt.body, stmt.orelse) if taken else (stmt.orelse, stmt.body)
            lowered = self.lower_body(body)
            if self.inline:
                return lowered  # the branch taken only
            saved = dict(self.env), dict(self.named)
            try:
                other = self.lower_body(orelse)
            except SpecError:
                other = orelse
            self.env, self.named = saved
            if not taken:
                lowered, other = other, lowered
            return [ast.If(stmt.test, lowered or [ast.copy_location(ast.Pass(), stmt)], other)]
        kind = type(stmt).__name__
        raise m.error(stmt, f"{kind} statements are not supported in a layer spec",
                      "write whole-array assignments and one return")

    def assign(self, stmt: ast.stmt, name: str, node: ast.expr, value) -> list[ast.stmt]:
        """Bind ``name``; a name assigned again (``p = p / s``) gets a new array (``p_2``), so views of
        its old value stay valid and DaCe sees no copies."""
        if isinstance(value, Static) or (isinstance(value, Num) and isinstance(node, ast.Constant)):
            self.env[name] = value
            return []
        if isinstance(value, Compare):
            raise self.m.error(node, "comparisons are only supported as np.where's condition",
                               "write np.where(a > b, x, y), or np.maximum for ReLU")
        if isinstance(value, Const):
            self.env[name] = replace(value, hint=value.hint or name)
            return []
        if isinstance(value, Part):
            if not isinstance(value.base.expr, ast.Name):
                value = replace(value, base=self.temp("whole", value.base))
            self.env[name] = value
            return []
        if isinstance(value, Num) and value.size is not None and not isinstance(value.expr, ast.Name):
            self.env[name] = value  # a size (half = E // 2): kept as computed, so slices see it
            return []
        value = self.known(value)
        hoisted = self.prelude[-1] if self.prelude else None
        if isinstance(value.expr, ast.Name) and hoisted is not None and hoisted.targets[0].id == value.expr.id:
            self.prelude.pop()  # ``mu = x.mean(...)``: the mean hoisted for this statement takes its name
            self.named = {k: v for k, v in self.named.items() if v != value.expr.id}
            value = replace(value, expr=hoisted.value)
        if isinstance(value.expr, ast.Name):
            self.env[name] = value  # a view or alias of another value, or the same computation again: no copy
            return []
        array = self.new_name(name) if name in self.written or name in self.m.generated() else name
        self.written.add(array)
        self.named[ast.dump(value.expr)] = array
        self.env[name] = replace(value, expr=load_name(array))
        return [ast.Assign([ast.Name(array, ast.Store())], value.expr)]

    def known(self, value):
        """The same computation assigned before (``x.var`` recomputing the user's ``x.mean``) is reused
        by name, so that the graph computes it once (names are never reassigned, see ``assign``)."""
        if isinstance(value, (Arr, Num)) and not isinstance(value.expr, ast.Name):
            name = self.named.get(ast.dump(value.expr))
            if name is not None:
                return replace(value, expr=load_name(name))
        return value

    def new_name(self, base: str) -> str:
        name, n = base, 1
        while name in self.taken or name in self.m.generated():
            n += 1
            name = f"{base}_{n}"
        self.taken.add(name)
        return name

    def temp(self, base: str, value: Arr) -> Arr:
        """Hoist ``value`` into a new name before the current statement (it is used twice)."""
        value = self.known(value)
        if isinstance(value.expr, ast.Name):
            return value
        name = self.new_name(f"{self.target}_{base}")
        self.written.add(name)
        self.named[ast.dump(value.expr)] = name
        self.prelude.append(ast.Assign([ast.Name(name, ast.Store())], value.expr))
        return Arr(load_name(name), value.stored, value.visible)

    # --- helpers for values -------------------------------------------------------------------

    def array(self, node: ast.expr) -> Arr:
        return self.as_array(node, self.expr(node))

    def as_array(self, node: ast.expr, value) -> Arr:
        """``value`` as an array of the graph: a constant of known value becomes a constant argument."""
        if isinstance(value, Const):
            return self.materialise(node, value)
        if isinstance(value, Part):
            raise self.m.error(node, "a slice used here is not supported", PART_HINT)
        if not isinstance(value, Arr):
            raise self.m.error(node, "expected an array here")
        return value

    def static(self, node: ast.expr):
        value = self.expr(node)
        if isinstance(value, Num) and value.value is not None and float(value.value).is_integer():
            return int(value.value)
        if not isinstance(value, Static):
            raise self.m.error(node, "expected a constant here (an axis, a tuple of axes)")
        return value.value

    def static_int(self, node: ast.expr) -> int:
        value = self.static(node)
        if not isinstance(value, int):
            raise self.m.error(node, "expected an integer here")
        return value

    def keyword(self, node: ast.Call, name: str):
        for keyword in node.keywords:
            if keyword.arg == name:
                return keyword.value
        return None

    def axis(self, node: ast.AST, axis, rank: int) -> int:
        if not isinstance(axis, int) or not -rank <= axis < rank:
            raise self.m.error(node, f"axis {axis} is out of range for an array with {rank} axes")
        return axis % rank

    def render_value(self, value) -> ast.expr:
        return value.expr if isinstance(value, (Arr, Num)) else static_node(value.value)

