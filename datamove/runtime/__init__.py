"""The exported layer at run time: a tuned plan's steps bound to kernels and run as a ``torch.nn.Module``.

Its public face is above it: ``datamove.export`` (the artifact, ``load_layer``, weights in and out)
and ``datamove.hf`` (the layer dropped into Hugging Face models).  It stands on the stages and the
kernel families (``dataflow``, ``layouts``, ``kernels``, ``harness``, ``families``), none of which
imports it; what a family's launcher and a step's launcher share (the store, ``Run``, ``Buffers``,
the ``Launcher`` base, the replay of recorded launches) lies below the families, in
``datamove.kernels.launcher`` and ``datamove.kernels.replay``.

- ``steps``: a plan's steps as launchers: the generated kernels, the GEMMs with their families'
  epilogues, the layout changes, and a family's own step kinds built from its launcher table;
  stacked tensors as views of one buffer.
- ``layer``: ``LayerProgram``, a plan bound to its fused training graph, dtype and device, running
  its forward and backward steps; ``TensorInterface``, the tensors at the layer's boundary.
- ``torch_program``: ``TorchProgram``, the same calls computed with PyTorch operations (the backend
  on a machine without a GPU).
- ``graphs``: ``LayerGraphs``, each layer instance's own CUDA graphs of its forward and backward.
- ``shapes``: the dims a call may size, which tuned plan runs a call, and that plan fitted to it.
- ``call_constants``: the constants over a call dim (a decoder's causal mask, its rotary tables as
  position tables) read at a call's sizes.
- ``module``: ``TunedLayer``, the ``torch.nn.Module``, and the custom ops ``datamove::layer_forward``
  and ``datamove::layer_backward`` that run a program under autograd and ``torch.compile``.
- ``weights``: a PyTorch module's state dict <-> the layer's parameters, by the spec's ``WEIGHTS``.
- ``runnable``: ``check_runnable``, each plan's programs built and run forward and backward dry on
  the meta device, no kernel launched: what ``datamove.export.write_artifact`` checks before writing.

Import order inside: ``steps`` <- ``layer`` <- ``graphs`` <- ``module``; ``module`` also imports
``shapes`` and ``torch_program``; ``layer``, ``torch_program`` and ``shapes`` import
``call_constants``, which imports nothing of the runtime; ``runnable`` imports ``steps``, ``layer``
and ``shapes``; ``weights`` imports nothing of ``datamove``.
"""
