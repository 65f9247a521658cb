"""The architecture: one frozen ``ArchSpec`` built from a Hugging Face config (``spec.py``),
per-family access to a model's layers (``adapters.py``) and config reading (``hf_config.py``)."""
