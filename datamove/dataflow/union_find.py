"""Classes of hashable items joined pairwise (union-find, path halving): an operator's letters
unified through the axes of the tensors its primitives share (``dataflow.fusion._naming``,
``layouts.space.operator_letters``)."""
from __future__ import annotations


class UnionFind:
    """``find(x)``: the representative of ``x``'s class (``x`` itself until joined); ``union(a, b)``
    joins their classes."""

    def __init__(self):
        self.parent: dict = {}

    def find(self, x):
        parent = self.parent
        parent.setdefault(x, x)
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    def union(self, a, b) -> None:
        ra, rb = self.find(a), self.find(b)
        if ra != rb:
            self.parent[rb] = ra
