"""datamove: the stages (``dataflow``, ``layouts``, ``kernels`` subpackages) and, in the top-level
modules, the code that wires them together: the main job, the exported layer and the report.

Nothing is imported here, so importing a stage does not pull in the modules above it."""
