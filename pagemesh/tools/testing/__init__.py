"""What the tests and the benchmarks both build on, kept here so that bench/ needs nothing
from tests/ (as `torch.testing` ships with torch): tiny random checkpoints
(`tiny_models`, `quant_checkpoints`), an OTLP trace receiver (`otlp_receiver`) and test hosts
in network namespaces (`netns`). Never
imported by the services. (Worker groups without a scheduler are `worker_svc.local_group`:
pagemesh imports no service.)"""
