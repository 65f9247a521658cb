"""Command lines above the methods: ``python -m compress.cli.iam`` (IAM's mapping and decoding)
and ``python -m compress.cli.distill`` (distillation on its own). The run (``python -m compress``),
the decoder (``python -m compress.decoder``) and the server (``python -m compress.serve``) have
their own ``__main__``."""
