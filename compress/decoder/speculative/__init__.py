"""Speculative decoding: ``generate.py`` (the loop), ``drafts.py``, ``layer_skip.py``, ``bandit.py``,
``gamma.py`` (the draft length schedule), ``cli.py`` (the decoder CLI's options)."""
