"""compress: model compression for LLMs, checkpoint -> stages -> run folder -> decoder -> report."""

__version__ = "0.1.0"
