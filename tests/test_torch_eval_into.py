"""A map evaluated into a buffer (``harness.torch_eval._evaluate_into``, the CPU layer's way to avoid
fresh large tensors): the same values as evaluating it plainly, whichever operand the buffer is,
with nested operations written into the buffer only where nothing still to be read is there."""
import pytest
import torch

from datamove.dataflow.expression import parse
from datamove.harness.torch_eval import FUNCTIONS, _evaluate_into

SHAPE = (3, 5, 7)


def _operands(shapes, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=gen, dtype=torch.float64) + 2.0 for shape in shapes]  # away from 0 for "/"


CASES = [
    ("in0 * (in1 - in2)", [SHAPE, SHAPE, (3, 5, 1)]),        # the softmax backward's form
    ("(in0 - in1) / in2", [SHAPE, (3, 5, 1), SHAPE]),
    ("exp(in0 - in1)", [SHAPE, (3, 5, 1)]),
    ("in0 * (in1 - exp(in2)) + in1", [SHAPE, SHAPE, SHAPE]),
    ("in0 * (in1 - in2)", [SHAPE, (3, 5, 1), (3, 5, 1)]),     # the nested part smaller than the buffer
    ("2.0 * (in0 + in1)", [SHAPE, SHAPE]),
]


@pytest.mark.parametrize("text, shapes, buffer", [  # the buffer: fresh, or an operand of the output's shape
    (text, shapes, buffer) for text, shapes in CASES
    for buffer in ["fresh", *(n for n, shape in enumerate(shapes) if shape == SHAPE)]])
def test_a_map_into_a_buffer_equals_its_plain_value(text, shapes, buffer):
    expression = parse(text)
    operands = _operands(shapes)
    expected = expression.evaluate([x.clone() for x in operands], {}, FUNCTIONS)
    into = torch.full(SHAPE, float("nan"), dtype=torch.float64) if buffer == "fresh" else operands[buffer]
    result = _evaluate_into(expression, operands, {}, into)
    if result is None:
        result = expression.evaluate(operands, {}, FUNCTIONS)
    torch.testing.assert_close(torch.broadcast_to(result, SHAPE), torch.broadcast_to(expected, SHAPE), rtol=0, atol=1e-12)


def test_the_softmax_backwards_form_makes_no_temporary_of_the_buffers_size():
    operands = _operands([SHAPE, SHAPE, (3, 5, 1)])
    into = operands[1]  # d_probs dies with the map: its memory is the buffer
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as profile:
        result = _evaluate_into(parse("in0 * (in1 - in2)"), operands, {}, into)
    assert result.data_ptr() == into.data_ptr()
    assert max((e.cpu_memory_usage for e in profile.events()), default=0) < into.numel() * into.element_size()


@pytest.mark.parametrize("text", ["in0 * (1 / sqrt(E) * (in1 / sqrt(E) < 30.0))", "in0 * (0.1 * (in1 > 0.0))"])
def test_a_number_times_a_comparison_stays_in_float64(text):
    """np.minimum's gradient after a scale (``in0 * (1 / sqrt(E) * (in1 / sqrt(E) < 30.0))``): torch
    took the number times the bool tensor in float32, so a float64 layer's gradients were 1e-8 off;
    the comparison is 0 / 1 in its operand's dtype, and the value NumPy's in float64, plainly or into a
    buffer."""
    from datamove.harness.torch_eval import _evaluate

    expression = parse(text)
    operands = [x * 20.0 for x in _operands([SHAPE, SHAPE], seed=3)]
    expected = expression.evaluate([x.numpy() for x in operands], {"E": 3.0})
    for result in (_evaluate(expression, operands, {"E": 3.0}),
                   _evaluate_into(expression, operands, {"E": 3.0}, torch.empty(SHAPE, dtype=torch.float64))):
        assert result.dtype == torch.float64
        torch.testing.assert_close(result, torch.from_numpy(expected), rtol=1e-15, atol=0)
