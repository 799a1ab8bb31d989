"""Test set-up: without a CUDA GPU, Triton kernels run through the interpreter.

TRITON_INTERPRET must be set before triton is first imported, so it is decided here from
the presence of a CUDA driver (torch.cuda), before any test module imports a kernel.
"""
import os

import pytest
import torch

HAS_GPU = torch.cuda.is_available()
if not HAS_GPU:
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords and not HAS_GPU:
            item.add_marker(skip_gpu)
