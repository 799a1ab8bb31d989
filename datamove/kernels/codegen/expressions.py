"""A map primitive's expression (``PrimitiveGraph`` text such as ``in0 * exp(in1 - N)``) printed
as Triton code and as the generated kernel's docstring, from its tree (``dataflow.expression``,
parsed once per text)."""
from __future__ import annotations

from datamove.dataflow.expression import parse

# every function of ``dataflow.expression.FUNCTIONS``; the ``_`` ones are the module's jit helpers (``source.PRELUDE``,
# ``source.CALLED_HELPERS``)
FUNCTIONS = {"exp": "tl.exp", "log": "tl.log", "sqrt": "tl.sqrt_rn", "maximum": "tl.maximum",
             "minimum": "tl.minimum", "abs": "tl.abs", "where": "tl.where", "tanh": "_tanh", "sign": "_sign",
             "log1p": "_log1p", "expm1": "_expm1"}


def triton_expression(expr: str, operands: list[str], dims) -> str:
    """``expr`` as Triton code: ``inK`` -> ``operands[K]``, a name of ``dims`` -> ``dim_<name>``,
    numbers as floats, small integer powers as products; another name or function is refused."""
    return parse(expr).source(inputs=operands, names={name: f"dim_{name}" for name in dims}, functions=FUNCTIONS,
                              constant=float, expand_powers=True)


def names_used(expr: str, names) -> set[str]:
    """The names of ``names`` that ``expr`` reads."""
    return set(parse(expr).names) & set(names)


def describe(prim, own: dict) -> str:
    """One line of the generated kernel's docstring for primitive ``prim`` (``own``: its letters ->
    the operator's): ``out[letters] = expression`` over the operands' names and letters."""
    names = {f"in{n}": f"{o.tensor}[{''.join(own[l] for l in o.letters)}]" for n, o in enumerate(prim.inputs)}
    out = f"{prim.output.tensor}[{''.join(own[l] for l in prim.output.letters)}]"
    if prim.kind == "reduce":
        return f"{out} = {prim.expr} over {''.join(own[l] for l in prim.reduced)} of {names['in0']}"
    return f"{out} = {prim.expression.source(inputs=[names[f'in{n}'] for n in range(len(prim.inputs))])}"


def describe_shuffle(prim, shuffle, own: dict) -> str:
    """The docstring line of a shuffle (``dataflow.shuffle``): ``out[letters] = factor * x[letters moved]`` per piece."""
    x = prim.inputs[shuffle.source]
    letter = own[shuffle.letter]
    out = f"{prim.output.tensor}[{''.join(own[l] for l in prim.output.letters)}]"
    moved = "".join(f"({letter} + shift)" if l == shuffle.read else own[l] for l in x.letters)
    pieces = "; ".join(f"{p.factor:g} * shift {p.shift} for {p.start} <= {letter} < {p.end}" for p in shuffle.pieces)
    return f"{out} = factor * {x.tensor}[{moved}] ({pieces})"
