"""GPU kernels (Triton) and plain-torch references with the same signatures."""
