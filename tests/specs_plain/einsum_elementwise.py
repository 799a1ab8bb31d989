"""Element-wise np.einsum (no summed letter) feeding a reduction, and a batched dot product."""
import numpy as np

from datamove.dataflow.spec import Tensor, dims

B, T, D = dims(B=3, T=5, D=7)
INDEX = {"b": B, "t": T, "d": D}


def weighted(x: Tensor("btd"), g: Tensor("d")):
    scaled = np.einsum("btd,d->btd", x, g)
    energy = np.sum(np.einsum("btd,btd->btd", scaled, np.tanh(x)), axis=-1)
    return energy + np.einsum("btd,btd->bt", x, scaled)
