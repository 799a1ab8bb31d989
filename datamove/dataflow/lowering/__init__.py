"""Plain NumPy in a layer spec, lowered to the dialect the DaCe front end reads.

People write ``h @ w + c``, ``x.mean(axis=-1, keepdims=True)``, ``0.5 * z * (1.0 + np.tanh(...))``;
``dataflow.sdfg`` / ``dataflow.sdfg_reader`` read explicit ``np.einsum``, ``np.sum`` / ``np.max`` with
integer axes, explicit ``None`` broadcasts and ``np.float32`` constants.  ``lower_spec`` rewrites the
layer function, and each helper it calls (one copy per distinct argument shapes), at the source
level before DaCe sees it.  It interprets the function's AST abstractly: every array value carries
its letters (from the arguments' annotations), so NumPy's shape rules can be applied by name.

Constructs the primitive graph has no kind for (it has einsums, maps and reductions over named
dims, no offsets, no index-dependent values) are lowered onto einsums with constants whose value
the front end knows.  Each becomes a constant argument of the layer (appended to the spec's,
``Tensor(letters, requires_grad=False)``) whose graph tensor carries its value as an expression of
its indices and the dims (``TensorInfo.value``, evaluated by ``dataflow.executor.known_value``, read
by ``dataflow.initial_values`` as a ``KnownValue``), so autodiff (no gradient to a constant), the
executor, fusion and the kernels treat it as any constant, and it follows the dims (``with_dims``).

Anything else is refused with ``file:line``, the construct as written and what to write instead.
A spec that needs none of this (``configs/bert.py``) is returned unchanged, function and all.

The modules, each with what it lowers in its docstring:

- ``lowered_module``: ``lower_spec``, the lowered functions compiled into a module of their own,
  ``spec_line`` (a lowered line's spec line, for DaCe's messages);
- ``walker``: ``FunctionLowering``, the walk over one function's statements (assignments, the
  return, branches on module constants), built from the mixins below;
- ``expressions``: names, numbers and sizes, operators, indexing, attributes, transposes, and the
  dispatch of NumPy calls and methods to the modules below;
- ``elementwise``: broadcasting, arithmetic, powers, ``np.where``;
- ``reductions``: ``np.sum`` / ``np.mean`` / ``np.var`` ... with axes and keepdims;
- ``contractions``: ``@``, ``np.matmul`` / ``np.dot`` / ``np.tensordot`` / ``np.einsum``;
- ``slices``: ``x[..., a:b]`` and ``np.concatenate`` (RoPE's ``rotate_half``);
- ``repeat``: ``np.repeat`` (GQA's ``repeat_kv``);
- ``masks``: ``np.arange`` / ``np.ones`` / ``np.tril`` ... constants of known value, causal masks;
- ``helpers``: calls of the spec's helper functions, specialised or inlined;
- ``spec_module``: the state of one spec's lowering (letters, constants made, errors);
- ``values``, ``syntax``, ``support``: the abstract values, the AST and sympy pieces, the tables
  of supported and refused NumPy.
"""
