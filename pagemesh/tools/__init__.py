"""The operator's and developer's tools: the `pagemesh` command (cli.py: up, generate, top,
admin, health, bench), the local mesh and its supervisor, `pagemesh top`, the load
generator (loadgen/) and the tiny test checkpoints (testing/). Services never import it;
it starts them as processes."""
