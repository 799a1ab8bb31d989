"""The replayed call's autograd node (``runtime.graphs._Replayed``, the path a CUDA-graph replay takes)
on the CPU with a stand-in replayer: it takes the parameters as the layer holds them (another
layout than the spec's), hands the replayer spec-order views, and gives each parameter's gradient
back in its held layout, with or without copying parameters in (FSDP2's ``shared``)."""
import pytest
import torch

from datamove.runtime.graphs import LayerGraphs, _Gradients
from datamove.runtime.layer import SpecOrder


class StandIn:
    """y = x @ w over spec letters (x: [s, d], w: [d, e]); records what it was handed."""

    def __init__(self, shared):
        self.statics, self.reads, self.shared = [None], [1], shared
        self.seed = torch.zeros(1)
        self.handed = {}

    def forward(self, activations, mask, views):
        self.handed["forward"] = views
        self.x, self.w = activations[0].detach(), views[0].detach()
        return [self.x @ self.w]

    def backward(self, grads, activations, views, order):
        self.handed["backward"] = views
        (dy,) = grads
        return order.held_grads([dy @ self.w.T, self.x.T @ dy], 1)  # as Replayer.backward: the held order


@pytest.mark.parametrize("shared", [None, object()], ids=["in place", "copied in"])
def test_the_replayed_node_takes_held_parameters_and_gives_their_gradients_held(shared):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(5, 3, generator=gen, requires_grad=True)
    held = torch.randn(4, 3, generator=gen).requires_grad_()  # stored over (e, d): the spec reads (d, e)
    order = SpecOrder(("w",), [(1, 0)])
    views = order.spec([held.detach()])
    graphs, replayer = LayerGraphs(), StandIn(shared)
    graphs.replayers[("p", None)] = [replayer]
    (y,) = graphs(replayer, (x,), [held], views, order, None)
    assert replayer.handed["forward"][0].shape == (3, 4)
    dy = torch.randn(5, 4, generator=gen)
    y.backward(dy)
    assert {type(n).__name__ for n, _ in y.grad_fn.next_functions if n is not None} == {"AccumulateGrad"}
    torch.testing.assert_close(x.grad, dy @ held.detach())  # dy @ w.T, w = held.T
    torch.testing.assert_close(held.grad, (x.detach().T @ dy).T)  # in the held layout (e, d)
    handed = replayer.handed["backward"]
    assert len(handed) == (0 if shared is None else 1)
    if shared is not None:
        assert handed[0].shape == (3, 4) and handed[0].data_ptr() == held.data_ptr()


def test_a_gradient_set_hands_out_fresh_aliases_in_the_held_order():
    gen = torch.Generator().manual_seed(1)
    dx, dw = torch.randn(5, 3, generator=gen), torch.randn(3, 4, generator=gen)  # dw over spec (d, e)
    gradients = _Gradients([dx, dw])
    order = SpecOrder(("w",), [(1, 0)])  # held over (e, d)
    for _ in range(2):  # the views are made once; every call's aliases are new tensors over the same memory
        assert gradients.held.free()  # nothing outside holds the set: a backward may write it again
        got = gradients.aliases(order, 1)
        assert all(g is not s for g, s in zip(got, (dx, dw)))
        assert got[0].data_ptr() == dx.data_ptr() and got[1].data_ptr() == dw.data_ptr()
        torch.testing.assert_close(got[0], dx, rtol=0, atol=0)
        torch.testing.assert_close(got[1], dw.T, rtol=0, atol=0)
        assert not gradients.held.free()  # held while the aliases live (as .grad, say)
        del got
