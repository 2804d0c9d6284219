"""The scheduler's pure core: plain Python, no gRPC, no torch, no I/O."""
