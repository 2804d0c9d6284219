"""Benchmarks: `pagemesh bench` (pagemesh/tools/loadgen), the peers (bench/peers), and the
scripts."""
