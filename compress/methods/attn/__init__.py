"""Attention conversion for a smaller KV cache: GQA/MQA mean-pooling (``gqa``), cross-layer
attention (``cla``) and multi-head latent attention (``mla``), each followed by distillation."""
