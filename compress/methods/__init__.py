"""Compression methods, one room each: ``quant`` (RTN, AWQ, LLM.int8), ``prune`` (Minitron),
``attn`` (GQA/MQA, MLA, CLA conversion), ``iam`` and ``distill``. Methods know no CLI."""
