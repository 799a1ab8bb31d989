"""Build the DaCe SDFG of a layer spec, with symbolic sizes (no compiler runs).

DaCe lowers ``np.einsum`` to MatMul library nodes on reshaped views, which loses the index
letters; the letters are the spine of datamove, so while parsing we record every einsum's string,
operand arrays and output array (``EinsumRecord``) for ``dataflow.sdfg_reader`` to read back.
"""
from __future__ import annotations

import contextlib
import types
from dataclasses import dataclass, field

import dace
import dace.frontend.common.einsum as dace_einsum
from dace.sdfg import nodes

from datamove.dataflow.lowering.support import SUPPORTED
from datamove.dataflow.spec import LayerSpec, SpecError


@dataclass(frozen=True)
class EinsumRecord:
    """One ``np.einsum`` call as parsed: ``subscripts`` like ``"phi,ibj->phbj"``, SDFG array names;
    ``reads``: per operand, the access node the einsum read it through (None where it made none)."""

    subscripts: str
    operands: tuple[str, ...]
    output: str
    reads: tuple = field(default=(), compare=False)

    @property
    def renamed_operands(self) -> tuple[str, ...]:
        """The operands under the names simplification gave them: it renames an array's access nodes
        in place (a helper's returned array becomes the name it is assigned to), and may drop them after."""
        return tuple(node.data if node is not None else name
                     for name, node in zip(self.operands, self.reads or [None] * len(self.operands)))


@contextlib.contextmanager
def _recording_einsums(records: list[EinsumRecord]):
    original = dace_einsum.create_einsum_sdfg

    def recorder(sdfg, state, einsum_string, *arrays, **kwargs):
        subscripts = str(einsum_string).replace(" ", "")
        if "->" not in subscripts:
            raise SpecError(f"np.einsum({subscripts!r}): write the output letters explicitly ('...->out')")
        sizes: dict[str, str] = {}
        for term, name in zip(subscripts.split("->")[0].split(","), arrays):
            for letter, size in zip(term, sdfg.arrays[name].shape):
                if sizes.setdefault(letter, str(size)) != str(size):
                    raise SpecError(f"contradictory dims: letter {letter} is {sizes[letter]} and {size} "
                                    f"in np.einsum({subscripts!r})")
        before = set(map(id, state.nodes()))
        output = original(sdfg, state, einsum_string, *arrays, **kwargs)
        reads = {node.data: node for node in state.nodes()
                 if id(node) not in before and isinstance(node, nodes.AccessNode) and node.data in arrays}
        records.append(EinsumRecord(subscripts, tuple(arrays), output, tuple(reads.get(a) for a in arrays)))
        return output

    dace_einsum.create_einsum_sdfg = recorder
    try:
        yield
    finally:
        dace_einsum.create_einsum_sdfg = original


def _annotated_copy(spec: LayerSpec) -> types.FunctionType:
    symbols = {dim: dace.symbol(dim) for dim in set(spec.letter_dims.values())}
    function = spec.function
    copy = types.FunctionType(function.__code__, function.__globals__, function.__name__,
                              function.__defaults__, function.__closure__)
    copy.__annotations__ = {
        arg.name: dace.float32[tuple(symbols[spec.letter_dims[letter]] for letter in arg.letters)]
        for arg in spec.arguments
    }
    return copy


def build_sdfg(spec: LayerSpec) -> tuple[dace.SDFG, list[EinsumRecord]]:
    """Parse the layer function into a simplified SDFG with symbolic sizes; returns it and its einsums."""
    records: list[EinsumRecord] = []
    program = dace.program(_annotated_copy(spec))
    try:
        with _recording_einsums(records):
            sdfg = program.to_sdfg(simplify=True)
    except SpecError as err:
        raise SpecError(f"{spec.path}: {err}") from None
    except Exception as err:  # DaCe's parser refused something: point at the spec line if it says one
        message = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise SpecError(f"{spec.path}: DaCe could not parse {spec.name}: {type(err).__name__}: {message}") from None
    callbacks = sorted(name for name, value in sdfg.symbols.items() if "callback" in str(value).lower())
    if callbacks:
        raise SpecError(f"{spec.path}: {', '.join(callbacks)} became a Python callback (a NumPy call DaCe does not "
                        f"support): write it with {SUPPORTED}")
    return sdfg, records
