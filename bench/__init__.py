"""Benchmarks: `pagemesh bench` (bench/loadgen), the peers (bench/peers), and the scripts."""
