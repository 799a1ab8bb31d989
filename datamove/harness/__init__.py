"""The tuning harness: variants of the kernels to measure, checks against float64, timing, worker processes, the tuning database, PyTorch eager baselines."""
