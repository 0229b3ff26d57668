"""Model registry: flavors are chosen by name (``[model] flavor`` in TOML)."""

from nsa_titan.models.nsa.args import MODEL_FLAVORS, NSAModelArgs, get_model_args
from nsa_titan.models.nsa.model import NSATransformer


def build_model(args: NSAModelArgs) -> NSATransformer:
    """Construct on the current default device (use ``torch.device('meta')`` to defer allocation)."""
    return NSATransformer(args)


__all__ = ["MODEL_FLAVORS", "NSAModelArgs", "NSATransformer", "build_model", "get_model_args"]
