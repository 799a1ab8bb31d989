"""datamove kernels stage: Triton tile kernels, contraction variants, benchmark harness, tuning database."""
