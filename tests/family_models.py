"""Tiny random models of every supported family, built from transformers' config classes (no
download): hidden 64, SmolLM2's vocabulary (49152) so the recipes' tokenizer fits."""

import torch

from compress.testing import SIZES

VOCAB = 49152
COMMON = dict(SIZES, vocab_size=VOCAB, max_position_embeddings=512)


def family_config(family: str, **overrides):
    """The tiny config of ``family``: llama (llama3 RoPE scaling), mistral (window 16), qwen2
    (q/k/v biases, window 16 on its upper layer), qwen3 (q/k norms), gemma3_text (window 16 on
    five of six layers, local and global theta, four (1+w) norms, GELU-tanh, tied head)."""
    from transformers import (
        Gemma3TextConfig,
        LlamaConfig,
        MistralConfig,
        Qwen2Config,
        Qwen3Config,
    )

    if family == "llama":
        kw = dict(
            COMMON,
            num_hidden_layers=2,
            tie_word_embeddings=True,
            rope_parameters=dict(
                rope_type="llama3",
                rope_theta=10000.0,
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=64,
            ),
        )
        cls = LlamaConfig
    elif family == "mistral":
        kw, cls = dict(COMMON, num_hidden_layers=2, sliding_window=16), MistralConfig
    elif family == "qwen2":
        kw = dict(
            COMMON,
            num_hidden_layers=2,
            use_sliding_window=True,
            sliding_window=16,
            max_window_layers=1,
            tie_word_embeddings=True,
        )
        cls = Qwen2Config
    elif family == "qwen3":
        kw = dict(COMMON, num_hidden_layers=2, head_dim=16, tie_word_embeddings=True)
        cls = Qwen3Config
    elif family == "gemma3_text":
        kw = dict(
            COMMON,
            num_hidden_layers=6,
            head_dim=16,
            sliding_window=16,
            query_pre_attn_scalar=16,
        )
        cls = Gemma3TextConfig
    else:
        raise ValueError(family)
    kw.update(overrides)
    return cls(**kw)


FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma3_text")


def family_model(family: str, seed: int = 0, **overrides):
    """A random model of ``family`` whose norms are not all ones (so a fold into a norm shows)."""
    from transformers import AutoModelForCausalLM

    from compress.arch.spec import spec_of

    config = family_config(family, **overrides)
    offset = spec_of(config).norm_offset
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:  # weight (offset + w) around 1
                p.copy_(1 - offset + 0.1 * torch.randn_like(p))
            else:
                p.normal_(0, 0.05)
    return model.eval()
