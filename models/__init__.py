"""Flax NNX GPT with Megatron tensor parallelism (gpt.py) and its mesh plumbing (parallel.py)."""
