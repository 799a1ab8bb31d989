"""Contractions: ``a @ b``, ``np.matmul``, ``np.dot``, ``np.tensordot`` and ``np.einsum`` without
``->`` become one explicit ``np.einsum`` over the operands' letters (the batch dims of ``@``
broadcast as NumPy's; a free letter that would repeat, as in ``q @ k.T``, gets another letter of
the same dim, INDEX's first); an ``np.einsum`` with ``->`` is kept as written, its operands' views
permuted onto their stored axes, unless its output repeats a letter or names one no operand has
(NumPy's errors: refused).  Einsums that are no GEMM (three operands, a letter summed within one
operand, no summed letter) are rewritten on the graph, ``dataflow.einsum_split``."""
from __future__ import annotations

import ast

from datamove.dataflow.lowering.syntax import as_tuple, axes_text, make_call, np_attr
from datamove.dataflow.lowering.values import Arr


class Contractions:
    """Mixin of ``FunctionLowering``: contractions."""

    def contract(self, node: ast.AST, operands: list[Arr], positions: list[list], output: list) -> Arr:
        """One explicit einsum.  ``positions[k][p]``: the index id of operand k's visible axis p (None:
        a size-1 axis); ``output``: the result's index ids (None: a size-1 axis it keeps).  Each
        index gets the letter of the first operand axis it is bound to, another letter of the same
        dim if that one is taken."""
        letters = self.m.letters
        bound: dict[object, list[str]] = {}
        for operand, ids in zip(operands, positions):
            if None in operand.stored:
                raise self.m.error(node, "a contraction operand with a size-1 axis of its own is not supported",
                                   "contract the array before adding the axis")
            for letter, index in zip(operand.letters, ids):
                if letter is not None and index is not None:
                    bound.setdefault(index, []).append(letter)
        names: dict[object, str] = {}
        for index, found in bound.items():
            for letter in found[1:]:
                if letters.dim(letter) != letters.dim(found[0]):
                    raise self.m.error(node, f"the contraction pairs axis {found[0]} ({letters.dim(found[0])}) "
                                       f"with axis {letter} ({letters.dim(letter)})",
                                       "check the operands' axes (transpose one with .T or np.swapaxes)")
            letter = found[0]
            if letter in names.values():
                letter = letters.fresh(letters.dim(letter), set(names.values()) | set(found))
            names[index] = letter
        terms = []
        for operand, ids in zip(operands, positions):
            terms.append("".join(names[ids[operand.visible.index(i)]] for i in range(len(operand.stored))))
        out = "".join(names[index] for index in output if index is not None)
        expr = make_call(np_attr("einsum"), ast.Constant(f"{','.join(terms)}->{out}"), *(o.expr for o in operands))
        visible = iter(range(len(out)))
        return Arr(expr, tuple(out), tuple(None if index is None else next(visible) for index in output))

    def matmul(self, node: ast.AST, a: Arr, b: Arr) -> Arr:
        na, nb = len(a.visible), len(b.visible)
        if na == 0 or nb == 0:
            raise self.m.error(node, "@ of a scalar", "use *")
        ids_a: list = [None] * na
        ids_b: list = [None] * nb
        ids_a[-1] = "k"
        ids_b[-2 if nb > 1 else -1] = "k"
        output: list = []
        if na > 1 and nb > 1:
            batch = max(na, nb) - 2
            for pos in range(batch):
                pa, pb = pos - (batch - (na - 2)), pos - (batch - (nb - 2))
                for ids, p, arr in ((ids_a, pa, a), (ids_b, pb, b)):
                    if p >= 0:
                        ids[p] = ("batch", pos)
                output.append(("batch", pos))
            ids_a[-2], ids_b[-1] = "m", "n"
            output += ["m", "n"]
        elif na > 1:
            for p in range(na - 1):
                ids_a[p] = ("a", p)
            output = list(ids_a[:-1])
        elif nb > 1:
            for p in range(nb):
                if p != nb - 2:
                    ids_b[p] = ("b", p)
            output = [ids_b[p] for p in range(nb) if p != nb - 2]
        self.check_pairs(node, [(a, ids_a), (b, ids_b)])
        return self.contract(node, [a, b], [ids_a, ids_b], self.kept(output, [(a, ids_a), (b, ids_b)]))

    def kept(self, output: list, operands: list) -> list:
        """Output ids that no operand binds to a letter are size-1 axes (None)."""
        bound = {i for arr, ids in operands for letter, i in zip(arr.letters, ids) if letter is not None}
        return [i if i in bound else None for i in output]

    def check_pairs(self, node: ast.AST, operands: list) -> None:
        """A contracted pair of a real axis and a size-1 axis is NumPy's error, not a broadcast."""
        seen: dict[object, list] = {}
        for arr, ids in operands:
            for letter, index in zip(arr.letters, ids):
                seen.setdefault(index, []).append(letter)
        for index, letters in seen.items():
            if index == "k" and None in letters and any(l is not None for l in letters):
                raise self.m.error(node, "the contracted axes do not match (a size-1 axis against "
                                   f"{next(l for l in letters if l)})", "check the operands' axes")

    def dot(self, node: ast.AST, a: Arr, b: Arr) -> Arr:
        na, nb = len(a.visible), len(b.visible)
        if na <= 2 and nb <= 2 or na == 1 or nb == 1:
            return self.matmul(node, a, b)
        ids_a = [("a", p) for p in range(na - 1)] + ["k"]
        ids_b = [("b", p) for p in range(nb)]
        ids_b[-2] = "k"
        output = ids_a[:-1] + [i for p, i in enumerate(ids_b) if p != nb - 2]
        self.check_pairs(node, [(a, ids_a), (b, ids_b)])
        return self.contract(node, [a, b], [ids_a, ids_b], self.kept(output, [(a, ids_a), (b, ids_b)]))

    def tensordot(self, node: ast.AST, a: Arr, b: Arr, axes) -> Arr:
        na, nb = len(a.visible), len(b.visible)
        if isinstance(axes, int):
            pairs = [(na - axes + i, i) for i in range(axes)]
        else:
            left, right = (as_tuple(x) for x in axes)
            if len(left) != len(right):
                raise self.m.error(node, "np.tensordot's axes lists differ in length")
            pairs = [(self.axis(node, x, na), self.axis(node, y, nb)) for x, y in zip(left, right)]
        ids_a = [("a", p) for p in range(na)]
        ids_b = [("b", p) for p in range(nb)]
        for n, (x, y) in enumerate(pairs):
            ids_a[x] = ids_b[y] = ("k", n)
        contracted = {("k", n) for n in range(len(pairs))}
        output = [i for i in ids_a + ids_b if i not in contracted]
        return self.contract(node, [a, b], [ids_a, ids_b], self.kept(output, [(a, ids_a), (b, ids_b)]))

    def einsum(self, node: ast.Call) -> Arr:
        m = self.m
        if not node.args or not isinstance(node.args[0], ast.Constant) or not isinstance(node.args[0].value, str):
            raise m.error(node, "np.einsum needs its subscripts as a string literal first",
                          "write np.einsum('ij,jk->ik', a, b)")
        subscripts = node.args[0].value.replace(" ", "")
        operands = [self.array(a) for a in node.args[1:]]
        if "." in subscripts:
            raise m.error(node, "np.einsum with ... is not supported", "name every axis with a letter")
        inputs, arrow, output = subscripts.partition("->")
        terms = inputs.split(",")
        if len(terms) != len(operands):
            raise m.error(node, f"np.einsum has {len(terms)} terms for {len(operands)} operands")
        for letter in output:
            if output.count(letter) > 1:
                raise m.error(node, f"the output {output!r} repeats the letter {letter}",
                              "give every axis of the result its own letter")
            if letter not in inputs:
                raise m.error(node, f"the output letter {letter} is in no operand's term",
                              "name in the output only letters of the operands (a letter it lacks is summed)")
        for term, operand in zip(terms, operands):
            if len(term) != len(operand.visible):
                raise m.error(node, f"term {term!r} has {len(term)} letters for an operand with "
                              f"{len(operand.visible)} axes {axes_text(operand.letters)}")
            if None in operand.letters:
                raise m.error(node, "an np.einsum operand with a size-1 (None) axis is not supported",
                              "pass the array without the added axis")
        if arrow:
            result = self.explicit_einsum(node, terms, output, operands)
        for term in terms:
            if len(set(term)) != len(term):
                raise m.error(node, f"term {term!r} repeats a letter (a diagonal)",
                              "give every axis of an operand its own letter")
        if arrow:
            return result
        counts = {c: inputs.count(c) for c in inputs if c != ","}
        out = sorted(c for c, n in counts.items() if n == 1)
        positions = [[c for c in term] for term in terms]
        return self.contract(node, operands, positions, out)

    def explicit_einsum(self, node: ast.Call, terms: list[str], output: str, operands: list[Arr]) -> Arr:
        """Kept as written (its letters are the user's); operands that are views get their terms
        permuted onto their stored axes; its letters must agree with INDEX and each other."""
        letters = self.m.letters
        for term, operand in zip(terms, operands):
            for letter, own in zip(term, operand.letters):
                dim = letters.dim(own)
                known = letters.dims.setdefault(letter, dim)
                if known != dim:
                    raise self.m.error(node, f"contradictory dims: letter {letter} is {known} but this np.einsum "
                                       f"uses it for an axis of size {dim}",
                                       "use another letter for that axis (INDEX maps each letter to one dim)")
        if all(o.plain for o in operands):
            expr = make_call(node.func, node.args[0], *(o.expr for o in operands))
            expr.keywords = node.keywords
        else:
            new_terms = ["".join(term[o.visible.index(i)] for i in range(len(o.stored))) for term, o in zip(terms, operands)]
            expr = make_call(np_attr("einsum"), ast.Constant(f"{','.join(new_terms)}->{output}"),
                             *(o.expr for o in operands))
        return Arr.of(expr, output)
