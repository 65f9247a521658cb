"""IAM attention mapping (Zhao, Li and Zhao, ACL 2025, arXiv 2507.11953): ``map.py`` (similarity,
mapping, the mapping file), ``decode.py`` (decoding with a small model alongside), ``stage.py``
(the pipeline stage), ``__main__.py`` (the ``map`` and ``generate`` CLI)."""
