"""RoPE's table as a layer input taking a gradient, read by q and by k before K's heads are repeated
over the query groups: its gradient sums over (b, h) on q's side and over (b, k) on k's, two
reductions of one table that once shared a kernel (d_sin: "reductions over different letter sets")."""
import numpy as np

from datamove.dataflow.spec import Tensor, dims

B, T, D, H, KV, E = dims(B=2, T=5, D=7, H=6, KV=2, E=4)
INDEX = {"b": B, "s": T, "d": D, "h": H, "k": KV, "e": E}
INPUTS = ("x", "sin")


def rope_table_gradient(x: Tensor("bsd"), wq: Tensor("dhe"), wk: Tensor("dke"), wo: Tensor("hed"), sin: Tensor("se")):
    q = np.einsum("bsd,dhe->bhse", x, wq) * sin
    k = np.repeat(np.einsum("bsd,dke->bkse", x, wk) * sin, H // KV, axis=1)
    return np.einsum("bhse,hed->bsd", q * k, wo)
