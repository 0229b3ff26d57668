"""Evaluation of trained models: held-out perplexity, needle/key-value retrieval by context length and
depth, and weight loading for inference (also used by ``python -m nsa_titan.generate``)."""
