"""IAM attention mapping (Zhao, Li and Zhao, ACL 2025, arXiv 2507.11953): ``map.py`` (similarity,
mapping, the mapping file), ``attention.py`` (the ``mapped`` attention kind, registered with the
decoder when this package is imported), ``cache.py`` (the small model's recording cache and the
large model's mapped cache), ``decode.py`` (decoding with a small model alongside), ``stage.py``
(the pipeline stage); the command line is ``compress.cli.iam``."""

from compress.methods.iam import attention  # noqa: F401  registers the "mapped" attention kind
