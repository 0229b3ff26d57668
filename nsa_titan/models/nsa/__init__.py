from nsa_titan.models.nsa.args import MODEL_FLAVORS, NSAModelArgs, get_model_args
from nsa_titan.models.nsa.model import NSATransformer

__all__ = ["MODEL_FLAVORS", "NSAModelArgs", "NSATransformer", "get_model_args"]
