"""Model registry: flavors are chosen by name (``[model] flavor`` in TOML).

``NSAModelArgs``, ``MODEL_FLAVORS`` and ``get_model_args`` import no torch: the config generates its ``[model]``
section from them. The torch side (``NSATransformer``, ``build_model``, ``resolve_attn_impl``) loads on first
access through the module ``__getattr__`` (PEP 562), so that reading a config or printing ``--help`` does not
pay for importing torch (seconds); ``from nsa_titan.models import build_model`` works as usual.
"""

import importlib

from nsa_titan.models.nsa.args import MODEL_FLAVORS, NSAModelArgs, get_model_args

_TORCH_SIDE = {
    "NSATransformer": "nsa_titan.models.nsa.model",
    "build_model": "nsa_titan.models.nsa.model",
    "resolve_attn_impl": "nsa_titan.models.nsa.attention",
}


def __getattr__(name: str):
    if name in _TORCH_SIDE:
        return getattr(importlib.import_module(_TORCH_SIDE[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["MODEL_FLAVORS", "NSAModelArgs", "NSATransformer", "build_model", "get_model_args", "resolve_attn_impl"]
