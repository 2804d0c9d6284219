"""Llama-family decoder and its config."""
