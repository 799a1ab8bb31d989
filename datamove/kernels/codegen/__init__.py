"""One Triton code generator for every fused element-wise / normalization operator.

Input: an operator (any group of "map" / "reduce" primitives of a ``PrimitiveGraph``, forward or
backward, fused or not) and a ``layouts.space.Configuration``.  Output: readable Triton source
(``generate_source``), written to a cache directory keyed by its hash, imported with importlib
and compiled by Triton (``compile_operator``).  Graphs are ``dataflow.graph`` objects (plain
Python, no DaCe), live or loaded from the snapshots of ``dataflow.snapshot``.

The generated kernel, over the operator's letters (``layouts.space.operator_letters``):
- program ids over the independent letters, flattened (plus blocks of the column axis for an
  element-wise operator); a 2-D tile [BLOCK_ROW, BLOCK_COL] whose axes flatten the letters of
  ``layouts.space.tile_axes`` (the vector letter innermost on the column axis);
- every tensor addressed as ``sum(idx_<letter> * stride_<tensor>_<letter>)`` with one stride
  argument per letter per tensor (any layout), masks for ragged edges;
- normalizations: mode "row" keeps whole reduction rows in the tile and runs the expression DAG
  once; mode "loop" makes one pass over chunks of the reduction per level of chained reductions
  (layernorm: mean, then variance, then the outputs; softmax: max, then sum, then outputs),
  statistics between passes, each output stored in the first pass that can compute it (a bias
  gradient's element-wise outputs in the pass that sums it); mode "split" (reductions along the
  tile's rows whose results nothing else reads) is "loop" over one of ``split`` slices of the
  rows: each program writes its fp32 partial sums to a scratch buffer, and the last program of a
  column block to arrive (an int32 counter per column block, reset by that program) adds them in
  slice order and stores the result, so the sum is the same whatever order programs finish in;
  an operator with column sums (``layouts.space.column_sums``: a layernorm backward joined with its
  parameter gradients) runs mode "row" on ``programs`` programs, each visiting every
  ``programs``-th block of rows and adding each block's rows into one row of sums (knob
  ``sums_kept`` "tile": into a tile of sums whose rows it adds after the loop), which it stores;
  ``<op>_sums_kernel``, launched after it, adds the programs' rows in program order and stores them;
- fp32 arithmetic and statistics whatever the storage dtype, stores cast to each output's dtype;
- dropout: a multiplication by a tensor of role "dropout" is not loaded but regenerated from the
  counter ``offset_<mask> + n`` (``n`` the element's row-major index over the mask's letters in
  spec order, ``dataflow.dropout_mask``), scaled by ``dropout_scale(p)``.  When the tile's column letters are
  the mask's trailing letters in spec order (consecutive columns = consecutive n), their extent is
  a multiple of 64 and BLOCK_COL too, the mask takes one Philox call per sixteen columns
  (``kernels.philox.keep_bits`` on a [rows, BLOCK_COL // 16] block of call counters, spread over the
  columns by ``unpack_gathered`` where a thread holds ``GATHER_ELEMENTS`` or more, else
  ``dropout_keep_grouped``, each thread drawing the calls it uses; whole
  groups of 64 counters; this needs ``offset_<mask> % 64 == 0``, which ``dataflow.executor.dropout_offsets`` guarantees and
  ``CompiledOperator.run`` checks); the same along the tile's rows when its row letters are the
  mask's trailing letters (one call per sixteen rows, on the transposed block of calls); where a
  reduction runs along the columns of such a tile (layernorms over i of BERT's ibj masks) and
  BLOCK_ROW is 2, 4, 8 or 16, the program takes rows of one Philox call per column
  (``part_plan.row_call_masks``): one call per BLOCK_ROW elements; otherwise one call per element (``kernels.philox.dropout_keep(seed, offset, n, threshold)``).
  Knob ``dropout="load"`` reads a stored mask (values 0 or ``dropout_scale(p)``) instead;
- sizes as runtime int arguments ``size_<letter>``, dim names used in expressions (``N``,
  ``sqrt(P)``) and dropout keep factors ``scale_<mask>`` (``PrimitiveGraph.scalars``: 1 in a graph
  whose probabilities are 0) as float arguments ``dim_<name>``.

The package: ``part_plan`` (what is decided for a part under its knobs), ``expressions`` (a map
primitive's expression as Triton code and as docstring text), ``emitter`` (``PartEmitter``: the
Triton body of one part, one method per emission mode), ``source`` (the generated module's text),
``compiled`` (``CompiledOperator``: caching, importing and launching it).
"""
from datamove.kernels.codegen.compiled import (CACHE_DIR, SUM_COLUMNS, SUM_ROWS, CompiledOperator, allocate,
                                               compile_operator)
from datamove.kernels.codegen.compiled import _compiled  # noqa: F401  (cleared by benchmarks/dropout_grouped.py)
from datamove.kernels.codegen.emitter import GATHER_ELEMENTS
from datamove.kernels.codegen.source import GENERATOR_VERSION, generate_source

__all__ = ["CACHE_DIR", "GATHER_ELEMENTS", "GENERATOR_VERSION", "SUM_COLUMNS", "SUM_ROWS", "CompiledOperator", "allocate",
           "compile_operator", "generate_source"]
