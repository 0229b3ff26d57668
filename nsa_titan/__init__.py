"""nsa_titan: train Native Sparse Attention (NSA) language models with PyTorch, torchtitan style.

Importing the package is deliberately cheap (no torch import): subpackages are imported on use,
e.g. ``nsa_titan.config``, ``nsa_titan.models``, ``nsa_titan.train``.
"""

__version__ = "0.1.0"
