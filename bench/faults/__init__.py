"""The fault matrix's parts (bench/fault_matrix.py runs them): the clients and their workload,
the meshes, the scenarios."""
