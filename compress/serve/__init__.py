"""An OpenAI-compatible server for a run folder: continuous batching over a paged KV cache.

``python -m compress.serve RUN [--host 127.0.0.1 --port 8000]``; see ``app.py`` for the routes.
"""
