"""The built-in decoder: our Llama-family model, a preallocated KV cache, and generation.

``python -m compress.decoder RUN --prompt "..."`` loads a run folder and generates.
"""
