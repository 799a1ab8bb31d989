"""The kernels: Triton tile kernels and their generator, contractions (cuBLAS and the Triton GEMM), the fused attention, layout changes, Philox dropout, direct launches, device queries."""
