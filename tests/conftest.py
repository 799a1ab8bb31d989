"""Test set-up: without a CUDA GPU, Triton kernels run through the interpreter.

TRITON_INTERPRET must be set before triton is first imported, so it is decided here from
the presence of a CUDA driver (torch.cuda), before any test module imports a kernel.
"""
import os
import tempfile

import pytest
import torch

HAS_GPU = torch.cuda.is_available()
# the jobs' kept analyses (datamove.dataflow.analysis_cache) in a folder of this run, not the user's
os.environ.setdefault("DATAMOVE_ANALYSIS_CACHE", tempfile.mkdtemp(prefix="datamove-analysis-"))
if not HAS_GPU:
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords and not HAS_GPU:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="session")
def llama_artifact(tmp_path_factory):
    """The main job's artifact of ``configs/llama.py`` at the spec's dims (the cost model's plan), built once."""
    from datamove.cli import main

    out = tmp_path_factory.mktemp("llama") / "out"
    assert main(["configs/llama.py", "--out", str(out)]) == 0
    return out


@pytest.fixture(scope="session")
def qwen2_artifact(tmp_path_factory):
    """The main job's artifact of ``configs/qwen2.py`` at the spec's dims (the cost model's plan), built once."""
    from datamove.cli import main

    out = tmp_path_factory.mktemp("qwen2") / "out"
    assert main(["configs/qwen2.py", "--out", str(out)]) == 0
    return out


@pytest.fixture(scope="session")
def qwen3_artifact(tmp_path_factory):
    """The main job's artifact of ``configs/qwen3.py`` at the spec's dims (the cost model's plan), built once."""
    from datamove.cli import main

    out = tmp_path_factory.mktemp("qwen3") / "out"
    assert main(["configs/qwen3.py", "--out", str(out)]) == 0
    return out


GPT2_DIMS = dict(B=2, T=13, D=32, H=2, E=16, F=40)  # E: a power of two, the fused attention (padding)


@pytest.fixture(scope="session")
def gpt2_artifact(tmp_path_factory):
    """The main job's artifact of ``configs/gpt2.py`` at ``GPT2_DIMS`` (the cost model's plan), built once."""
    from datamove.cli import main

    out = tmp_path_factory.mktemp("gpt2") / "out"
    assert main(["configs/gpt2.py", "--dims", ",".join(f"{k}={v}" for k, v in GPT2_DIMS.items()), "--out", str(out)]) == 0
    return out
