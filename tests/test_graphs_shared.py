"""What the layers of one program share under FSDP2 (``datamove.runtime.graphs.SharedStatics``), on
the CPU (kernels through the Triton interpreter): the static parameters each replay copies its
layer's into, and the gradient sets the backward graphs copy theirs into.  Replays themselves need
CUDA: ``tests/test_graphs_gpu.py``'s FSDP2 tests.
"""
import pytest
import torch

from datamove.runtime.graphs import GRADIENT_SETS, SharedStatics, shared_statics
from datamove.runtime.layer import SEED_RANGE
from datamove.runtime.steps import Run
from plans import selected_plan
from test_export import BERT_DIMS, load, randomize, write

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="float32 through the Triton interpreter (CPU)")


@pytest.fixture(scope="module")
def bert(tmp_path_factory):
    return write(tmp_path_factory.mktemp("shared"), "bert", BERT_DIMS, selected_plan)


def layout(tensors: list[torch.Tensor]) -> list[tuple]:
    """Per tensor: shape, strides, offset, and the first tensor sharing its storage."""
    storages = [t.untyped_storage().data_ptr() for t in tensors]
    return [(tuple(t.shape), t.stride(), t.storage_offset(), storages.index(s)) for t, s in zip(tensors, storages)]


def test_siblings_copy_their_parameters_into_one_static_copy_laid_out_as_theirs(bert):
    """One ``SharedStatics`` per program: siblings share it, the evaluation program has its own.  Its
    parameters are laid out as the module's (strides, a stacked group's members slices of one
    storage), and a copy-in leaves each layer's values there in turn, outside autograd's graph."""
    layer = load(bert)
    twin = layer.sibling()
    randomize(twin, 5)
    program = layer.program(True)
    shared = shared_statics(program)
    assert shared_statics(twin.program(True)) is shared
    assert shared_statics(layer.program(False)) is not shared
    assert layout(shared.tensors) == layout(layer._spec_tensors(layer._held()))
    assert any(len(group) > 1 and group[0] in layer.interface.parameters for group in program.buffers.group_of.values())
    for source in (layer, twin):
        values = source._spec_tensors(source._held())  # the views a training call reads
        shared.copy_in(values)
        for static, value in zip(shared.tensors, values):
            torch.testing.assert_close(static, value.detach(), rtol=0, atol=0)
        assert not any(t.requires_grad for t in shared.tensors)


def test_gradient_sets_are_laid_out_as_the_backward_writes_and_handed_out_while_free(bert):
    """A gradient set is laid out as ``call_backward`` returns the gradients (so the graphs' copy into
    it is one element-wise pass); ``free_gradients`` hands out one nothing outside holds, makes
    another while one is held, and none once ``GRADIENT_SETS`` are."""
    layer = load(bert)
    program = layer.program(True)
    x = torch.randn(*program.torch_shapes["x"], generator=torch.Generator().manual_seed(1))
    run = Run(torch.randint(0, SEED_RANGE, (1,)), None)
    inputs = [x, *layer._spec_tensors(layer._held())]
    with torch.no_grad():
        outputs, kept = program.call_forward(inputs, run)
        written = program.call_backward(inputs, kept, [torch.ones_like(y) for y in outputs], run)
    shared = SharedStatics(program)
    first = shared.free_gradients()
    assert layout(first.grads) == layout(written)
    assert shared.free_gradients() is first
    held = [first.grads[0].detach()]  # an alias outside, as autograd's .grad
    second = shared.free_gradients()
    assert second is not first and second.grads[0].data_ptr() != first.grads[0].data_ptr()
    held.append(second.grads[-1].detach())
    assert len(held) == GRADIENT_SETS and shared.free_gradients() is None
    del held[0]
    assert shared.free_gradients() is first


def test_a_programs_statics_go_with_it_without_a_cycle_collection(bert):
    """The statics live on their program (``shared_statics``), device memory under FSDP2: a deleted
    layer's program and its statics are freed once nothing holds them, at once (the statics held
    their program back: a reference cycle, kept until Python's cyclic collector ran, disabled here)."""
    import gc
    import weakref

    layer = load(bert)
    program = layer.program(True)
    shared = shared_statics(program)
    assert shared.free_gradients() is not None  # made from its program's backward
    freed = weakref.ref(program), weakref.ref(shared)
    gc.collect()
    gc.disable()
    try:
        del layer, program, shared
        assert [ref() for ref in freed] == [None, None]
    finally:
        gc.enable()
