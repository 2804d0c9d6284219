"""Benchmarks: `pagemesh bench` (pagemesh/loadgen), the peers (bench/peers), and the scripts."""
