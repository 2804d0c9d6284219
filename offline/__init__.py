"""vLLM's offline API on pagemesh's engine core: `LLM` (offline/llm.py) and its
outputs. Import from `pagemesh` (`from pagemesh import LLM, SamplingParams`)."""
