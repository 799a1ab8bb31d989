"""Map expressions as trees (``dataflow.expression``): parsing, printing, evaluation, derivatives,
structural queries and the refusals."""
import ast
import math

import numpy as np
import pytest
import torch

from datamove.dataflow.expression import (ARITY, FUNCTIONS, Binary, Call, Compare, Constant, ExpressionError, Input, Name,
                                          Unary, parse)
from datamove.dataflow.graph import Operand, Primitive, is_expression
from datamove.harness.torch_eval import FUNCTIONS as TORCH_FUNCTIONS

# one expression per construct and function of the language, and the forms the graphs hold
EXPRESSIONS = [
    "in0 + in1", "in0 - in1", "in0 * in1", "in0 / in1", "in0 ** 3", "-in0", "+in0", "in0 * (in1 > 0)",
    "in0 * (in1 >= 0.5)", "in0 * (in1 < 0)", "in0 * (in1 <= 1)", "in0 * (in1 == in1)", "in0 * (in1 != 0)",
    "exp(in0)", "log(in1)", "sqrt(in1)", "tanh(in0)", "abs(in0)", "sign(in0)", "maximum(in0, 0)",
    "minimum(in0, in1)", "where(in0 > 0, in1, 0.1 * in1)", "in0 / sqrt(P)", "in0 * (in1 > 0) * scale_drop",
    "(in0 - (in1 + in2 * in3) / (N)) / in4", "0.5 * in0 * (1 + tanh(0.7978845608028654 * (in0 + 0.044715 * in0 ** 3)))",
    "in0 - in1 - in2", "in0 - (in1 - in2)", "in0 ** in1", "(-in0) ** 2", "-in0 ** 2", "in0 + in1 + in2 + in3",
    "where(in0 < 0, ((- 1000000000.0)), in1)", "1e-05 + in0", "in0 * -(sign(in1) / ((1.0 + abs(in1)) * (1.0 + abs(in1))))",
    "log1p(in1)", "expm1(in0)", "where(in0 < -0.5, ((- 0.5)), where(in0 > 0.75, (0.75), in0))",
]
SCALARS = {"P": 64.0, "N": 1024.0, "scale_drop": 1.25}


def _reference(text: str, inputs: list, functions=FUNCTIONS):
    """What the graph's users computed before the trees: ``eval`` of the text."""
    namespace = {**SCALARS, **functions, **{f"in{k}": value for k, value in enumerate(inputs)}}
    return eval(text, {"__builtins__": {}}, namespace)  # noqa: S307 - the test's own expressions


def _inputs(rng, count: int = 5, size: int = 17) -> list[np.ndarray]:
    """float64 inputs away from 0 (log, sqrt and / are defined there), of both signs for in0."""
    values = [rng.uniform(0.3, 2.0, size) for _ in range(count)]
    values[0] = values[0] * rng.choice([-1.0, 1.0], size)
    return values


@pytest.mark.parametrize("text", EXPRESSIONS)
def test_parse_and_print_round_trip(text):
    tree = parse(text)
    assert tree.source() == ast.unparse(ast.parse(text, mode="eval"))  # the printing every stored derivation used
    assert parse(tree.source()) == tree
    assert parse(text) is tree  # parsed once per text
    assert parse(text.replace(" ", "")) == tree


@pytest.mark.parametrize("text", EXPRESSIONS)
def test_evaluation_matches_numpy_and_torch(text):
    rng = np.random.default_rng()  # fresh inputs on every run
    inputs = _inputs(rng)
    with np.errstate(all="ignore"):
        expected = np.asarray(_reference(text, inputs), dtype=np.float64)
        value = np.asarray(parse(text).evaluate(inputs, SCALARS), dtype=np.float64)
    np.testing.assert_array_equal(value, expected)
    tensors = [torch.from_numpy(x) for x in inputs]
    in_torch = parse(text).evaluate(tensors, SCALARS, TORCH_FUNCTIONS)
    np.testing.assert_allclose(np.broadcast_to(torch.as_tensor(in_torch, dtype=torch.float64).numpy(), expected.shape),
                               np.broadcast_to(expected, expected.shape), rtol=1e-12, atol=1e-300)


@pytest.mark.parametrize("function", sorted(FUNCTIONS))
def test_each_function_against_numpy(function):
    rng = np.random.default_rng()
    a, b, c = rng.normal(size=(3, 23))
    args = {1: [np.abs(a) + 0.1], 2: [a, b], 3: [a > 0, b, c]}[ARITY[function]]
    text = f"{function}({', '.join(f'in{k}' for k in range(len(args)))})"
    np.testing.assert_array_equal(parse(text).evaluate(args, {}), FUNCTIONS[function](*args))
    in_torch = parse(text).evaluate([torch.from_numpy(x) for x in args], {}, TORCH_FUNCTIONS)
    np.testing.assert_allclose(in_torch.numpy(), FUNCTIONS[function](*args), rtol=1e-12)


# --- derivatives --------------------------------------------------------------------------------

DIFFERENTIABLE = [
    "in0 * in1", "in0 / sqrt(P)", "in0 / in1", "maximum(in0, 0)", "minimum(in0, in1) * in0", "-in0 + +in1",
    "tanh(0.5 * in0 * in1) + exp(-in0)", "log(in0 * in0 + 1) - sqrt(in1 * in1 + 2)", "in0 ** 3 / (1 + abs(in1))",
    "in1 ** in0", "where(in0 > 0, in0 * in1, exp(in1))", "in0 * (in1 > 0) * scale_drop", "maximum(in1, in0 * in1)",
    "0.5 * in0 * (1 + tanh(0.7978845608028654 * (in0 + 0.044715 * in0 * in0 * in0)))",
    "(in0 - (in1 + in0 * in1) / (N)) / in1",
    "log1p(in0 * in0 * in1) + expm1(in0 * in1)", "sign(in0) * log1p(abs(in0)) * in1",
    "where(in0 < -0.5, ((- 0.5)), where(in0 > 0.75, (0.75), in0)) * in1",
]


@pytest.mark.parametrize("text", DIFFERENTIABLE)
def test_derivatives_match_finite_differences(text):
    rng = np.random.default_rng()
    point = [rng.uniform(0.2, 1.5, 13) * rng.choice([-1, 1], 13), rng.uniform(0.3, 2.0, 13)]
    tree, h = parse(text), 1e-6
    for k in range(2):
        derivative = tree.derivative(k)
        assert set(derivative.inputs) <= {0, 1}
        up, down = list(point), list(point)
        up[k], down[k] = point[k] + h, point[k] - h
        numeric = (tree.evaluate(up, SCALARS) - tree.evaluate(down, SCALARS)) / (2 * h)
        exact = np.broadcast_to(derivative.evaluate(point, SCALARS), numeric.shape)
        np.testing.assert_allclose(exact, numeric, rtol=1e-6, atol=1e-8)


def test_derivatives_are_simplified_as_the_derivation_prints_them():
    assert parse("in0 + in1").derivative(0) == Constant(1)
    assert parse("in0 * in1").derivative(1).source() == "in0"
    assert parse("in0 * 3").derivative(1) == Constant(0)
    assert parse("maximum(in0, 0)").derivative(0).source() == "in0 > 0"
    assert parse("in0 / sqrt(P)").derivative(0).source() == "1 / sqrt(P)"
    assert parse("exp(-in0)").derivative(0).source() == "exp(-in0) * -1"
    assert parse("tanh(in0)").derivative(0).source() == "1 - tanh(in0) ** 2"
    assert parse("in0 ** 3").derivative(0).source() == "3 * in0 ** (3 - 1)"
    assert parse("log1p(in0)").derivative(0).source() == "1 / (1 + in0)"
    assert parse("expm1(2 * in0)").derivative(0).source() == "exp(2 * in0) * 2"
    assert parse("sign(in0)").derivative(0) == Constant(0)  # torch's, at 0 too
    assert parse("where(in0 < -0.5, -0.5, where(in0 > 0.75, 0.75, in0))").derivative(0).source() == \
        "where(in0 < -0.5, 0, where(in0 > 0.75, 0, 1))"  # np.clip's: 1 on the bounds, as torch.clamp's


def test_every_table_of_functions_holds_the_languages():
    """``FUNCTIONS`` is the one list of the language's functions: torch's, Triton's and sympy's tables hold
    exactly its names, and each one has a derivative (a function added without one, or missing in a
    backend, fails here rather than in a layer's backward or kernel)."""
    from datamove.dataflow.closed_forms import SYMPY_FUNCTIONS
    from datamove.kernels.codegen.expressions import FUNCTIONS as TRITON_FUNCTIONS

    assert set(TORCH_FUNCTIONS) == set(TRITON_FUNCTIONS) == set(SYMPY_FUNCTIONS) == set(ARITY) == set(FUNCTIONS)
    for name, arity in ARITY.items():
        args = (Compare(">", Input(0), Constant(0)), Input(1), Input(2)) if name == "where" else \
            tuple(Input(k) for k in range(arity))
        for k in range(arity):
            Call(name, args).derivative(k)  # no ExpressionError


# --- structure ----------------------------------------------------------------------------------

def test_structural_equality_and_matching():
    assert parse("in0+in1") == parse("in0 + in1") == parse("(in0) + (in1)") == Binary("+", Input(0), Input(1))
    assert parse("maximum(in0, 0.0)") == parse("maximum(in0,0)")  # 0 and 0.0 are one number
    assert parse("maximum(in0, 0)").source() == "maximum(in0, 0)" and parse("maximum(in0, 0.0)").source() == "maximum(in0, 0.0)"
    assert parse("in1 + in0") != parse("in0 + in1")
    assert parse("in1 + in0").matches("in0 + in1", commutative=True)
    assert parse("(in1 > 0) * in0").matches("in0 * (in1 > 0)", commutative=True)
    assert not parse("in1 - in0").matches("in0 - in1", commutative=True)
    assert not parse("maximum(0, in0)").matches("maximum(in0, 0)", commutative=True)  # maximum keeps its order
    assert parse("in1 * in0").matches("in0 * in1", "in1 * in0")
    assert is_expression("in0 *in1", "in1 * in0", "in0 * in1") and not is_expression("in0 * in1", "in0 + in1")
    assert len({parse("in0 * 2"), parse("in0*2.0"), parse("(in0 * 2)")}) == 1


def test_structural_queries():
    tree = parse("in2 * (in0 > 0) / sqrt(P) + scale_drop")
    assert tree.inputs == (0, 2) and tree.names == {"P", "scale_drop"} and tree.functions == {"sqrt"}
    assert parse("in3").input_index == 3 and parse("in3 * 1").input_index is None
    assert parse("in0 + in1 + in2").is_sum_of_inputs(3) and not parse("in0 + (in1 + in2)").is_sum_of_inputs(3)
    assert not parse("in0 + in2").is_sum_of_inputs(2) and not parse("in1 + in0").is_sum_of_inputs(2)
    assert parse("in1 + in0").is_sum_of_inputs() and parse("in2").is_sum_of_inputs() and parse("in0+(in1+in2)").is_sum_of_inputs()
    assert not parse("in0 - in1").is_sum_of_inputs() and not parse("in0 + 1").is_sum_of_inputs()
    assert parse("in0 * 0.125").scale_of(0) == Constant(0.125)
    assert parse("sqrt(P) * in0").scale_of(0) == parse("sqrt(P)")
    assert parse("in0 / sqrt(P)").scale_of(0) == parse("1 / sqrt(P)")
    assert parse("sqrt(P) / in0").scale_of(0) is None and parse("in0 * in0").scale_of(0) is None
    assert parse("in0 * in1").scale_of(0) is None and parse("in0 + 1").scale_of(0) is None
    assert parse("in0 / sqrt(P)").linear_factor(SCALARS) == pytest.approx(1 / 8)
    assert parse("0.5 * in0 * 2").linear_factor(SCALARS) == 1.0 and parse("in0 + 1").linear_factor(SCALARS) is None
    assert parse("exp(in0)").linear_factor(SCALARS) is None
    assert parse("in0 / sqrt(P)").flop() == 1  # sqrt(P) reads no tensor: free
    assert parse("maximum(in0, 0)").flop() == 0 and parse("-in0").flop() == 1 and parse("+in0").flop() == 0
    assert parse("0.5 * in0 * (1 + tanh(0.79 * (in0 + 0.04 * in0 * in0 * in0)))").flop() == 9
    assert parse("in0 * (in1 > 0) * scale_drop").flop() == 2
    gelu = parse("0.5 * in0 * (1 + tanh(in0))")
    assert gelu.substitute({0: parse("in1 * in2")}).source() == "0.5 * (in1 * in2) * (1 + tanh(in1 * in2))"
    assert parse("in0 + in1").substitute({0: Input(1), 1: Input(0)}).source() == "in1 + in0"  # all at once


def test_printing_for_other_languages():
    tree = parse("in0 * (1 - tanh(in1) ** 2) / N + maximum(in1, 0)")
    triton = tree.source(inputs=["x", "y"], names=lambda n: f"dim_{n}", constant=float, expand_powers=True,
                         functions={"tanh": "_tanh", "maximum": "tl.maximum"})
    assert triton == "x * (1.0 - _tanh(y) * _tanh(y)) / dim_N + tl.maximum(y, 0.0)"
    with pytest.raises(ExpressionError, match="unsupported function in a map expression: tanh"):
        tree.source(functions={"maximum": "tl.maximum"})
    with pytest.raises(ExpressionError, match=r"'\*\*' only with a constant integer exponent 1..4, not 5.0"):
        parse("in0 ** 5").source(constant=float, expand_powers=True)
    assert parse("in0 ** 2").source(expand_powers=True) == "in0 * in0"
    assert parse("in1 * in0").source(inputs=lambda k: f"t{k}[ij]") == "t1[ij] * t0[ij]"
    assert repr(parse("in0+in1")) == "parse('in0 + in1')" and str(parse("in0+in1")) == "in0 + in1"


@pytest.mark.parametrize("text, message", [
    ("erf(in0)", "unsupported function in a map expression: erf"),
    ("np.exp(in0)", "unsupported function in a map expression: np.exp"),
    ("exp(in0, in1)", "unsupported call of exp"),
    ("maximum(in0)", "unsupported call of maximum"),
    ("exp(x=in0)", "unsupported call of exp"),
    ("in0 // 2", "unsupported construct"),
    ("in0 % 2", "unsupported construct"),
    ("in0 & in1", "unsupported construct"),
    ("in0 and in1", "unsupported construct"),
    ("not in0", "unsupported construct"),
    ("0 < in0 < 1", "unsupported construct"),
    ("in0 if in1 else in2", "unsupported construct"),
    ("in0[0]", "unsupported construct"),
    ("in0.T", "unsupported construct"),
    ("lambda: in0", "unsupported construct"),
    ("'in0'", "unsupported constant"),
    ("in0 * True", "unsupported constant"),
    ("in0 * 1j", "unsupported constant"),
    ("in01 + 1", "unsupported input name"),
    ("exp + in0", "unsupported function without a call"),
    ("in0 +", "is not an expression"),
    ("x = in0", "is not an expression"),
])
def test_unsupported_syntax_is_refused(text, message):
    with pytest.raises(ExpressionError, match=message):
        parse(text)


def test_unknown_name_is_refused_when_evaluated():
    with pytest.raises(ExpressionError, match="unknown name 'Q'"):
        parse("in0 * Q").evaluate([1.0], {"P": 2.0})


def test_primitive_holds_its_tree():
    prim = Primitive("map:y", "map", (Operand("x", "ij"),), Operand("y", "ij"), "maximum(in0,0)")
    assert prim.expression is prim.expression and prim.expression == Call("maximum", (Input(0), Constant(0)))
    assert prim.expr == "maximum(in0,0)"  # the stored text is untouched
    assert prim == Primitive("map:y", "map", (Operand("x", "ij"),), Operand("y", "ij"), "maximum(in0,0)")
    with pytest.raises(ValueError, match="no map expression"):
        Primitive("r", "reduce", (Operand("x", "ij"),), Operand("y", "i"), "sum").expression
    assert Unary("-", Name("P")).source() == "-P" and Compare(">", Input(0), Constant(0)).source() == "in0 > 0"
    assert not math.isnan(parse("sign(in0)").evaluate([-2.0], {}))
