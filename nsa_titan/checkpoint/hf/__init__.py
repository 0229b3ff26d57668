"""Files the exporter copies into an export folder (``modeling_nsa.py``: the model for transformers' AutoModel)."""
