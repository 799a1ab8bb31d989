"""A process group of this process alone (FSDP2 over one rank), for tests."""
import contextlib


@contextlib.contextmanager
def one_process_group(tmp_path, backend: str):
    """A ``backend`` ("gloo" on the CPU, "nccl" on a GPU) process group of this process alone."""
    import torch.distributed as dist

    dist.init_process_group(backend, init_method=f"file://{tmp_path / 'init'}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()
