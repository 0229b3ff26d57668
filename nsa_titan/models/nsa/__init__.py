"""The NSA transformer: ``args`` (settings, flavors; no torch), ``model`` (the transformer), ``attention`` (the
modules and the choice of implementation), ``reference`` (the spec), ``torch_impl``, ``decode`` (KV cache)."""

from nsa_titan.models.nsa.args import MODEL_FLAVORS, NSAModelArgs, get_model_args

__all__ = ["MODEL_FLAVORS", "NSAModelArgs", "get_model_args"]
