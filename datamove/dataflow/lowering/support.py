"""What plain NumPy the lowering knows: the functions it maps onto the DaCe dialect (element-wise,
binary, reductions, the maps a constant's value may use), and for what it refuses, what to write
instead (``HINTS``, ``PART_HINT``, ``SUPPORTED``; ``dataflow.sdfg`` and ``dataflow.sdfg_reader`` name
``SUPPORTED`` in their refusals too)."""
from __future__ import annotations

import ast

from datamove.dataflow.expression import ARITY, FUNCTIONS

# NumPy's element-wise functions of one argument -> the map expression's (the same name; ``np.absolute`` is abs)
UNARY = {**{name: name for name, arity in ARITY.items() if arity == 1}, "absolute": "abs"}
BINARY = {"add": ast.Add, "subtract": ast.Sub, "multiply": ast.Mult, "divide": ast.Div, "true_divide": ast.Div}
REDUCERS = {"sum": "sum", "max": "max", "min": "min", "amax": "max", "amin": "min", "mean": "mean",
            "var": "var", "std": "std", "add.reduce": "sum", "maximum.reduce": "max", "minimum.reduce": "min"}
HINTS = {  # refused NumPy functions and methods -> what to write instead
    "reshape": "name every axis with its own letter instead, e.g. a per-head weight as Tensor(\"hde\") and "
               "x[:, None] @ w for its batch of heads",
    "stack": "declare the pieces as separate Tensor arguments",
    "split": "slice the axis into its parts instead: x[..., :h], x[..., h:]",
    "astype": "drop it: the spec computes in its own dtype",
    "softmax": "write the softmax out with np.max, np.exp and np.sum",
    "erf": "write GELU in its tanh form: 0.5 * x * (1 + np.tanh(0.7978845608 * (x + 0.044715 * x ** 3)))",
    "random": "declare a Dropout(letters, p) argument and multiply by it",
    "float64": "write np.float32(...) or a plain Python number (taken in the spec's dtype)",
}
SUPPORTED = ("@, np.einsum, np.matmul, np.dot, np.tensordot, np.sum/max/min/mean/var/std, np.exp, np.log, "
             "np.sqrt, np.tanh, np.log1p, np.expm1, np.abs, np.sign, np.square, np.reciprocal, np.maximum, "
             "np.minimum, np.clip, np.where, "
             "np.transpose, np.swapaxes, x[..., a:b] with np.concatenate, np.repeat, np.arange, np.ones, "
             "np.zeros, np.full, np.tril, np.triu, arithmetic and ** with a constant exponent")
PART_HINT = ("a slice x[..., a:b] is supported element-wise (with arrays that broadcast along that axis, or are "
             "sliced the same way) and put back together with np.concatenate along the axis it was cut from, "
             "as rotate_half does; for anything else declare the part as its own Tensor argument")
CONST_FUNCTIONS = frozenset(FUNCTIONS)  # what a constant's value may call (``executor.known_value`` evaluates it)
