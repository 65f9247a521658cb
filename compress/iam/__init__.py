"""IAM attention mapping (Zhao, Li and Zhao, ACL 2025, arXiv 2507.11953): ``map.py`` (similarity,
mapping, the mapping file), ``stage.py`` (the pipeline stage), ``__main__.py`` (the CLI); the
decoder side is ``compress.iam.decode``."""
