"""Config of a multi-head-latent-attention (MLA) Llama converted from MHA/GQA (MHA2MLA,
Ji et al. 2025, arXiv 2502.14837).

A Llama config plus ``mla_rope_pairs`` (p: RoPE frequency pairs kept per KV head, chosen per
layer and head; their indices are the ``rope_index`` tensors) and ``kv_lora_rank`` (L: the
latent width of a layer, shared by its KV heads; ``mla_d_kv`` = L / KV heads).
Self-contained (transformers only), so a run folder can carry it for ``trust_remote_code=True``.
"""

from transformers import LlamaConfig


class MLAConfig(LlamaConfig):
    model_type = "compress_mla"

    def __init__(
        self, mla_rope_pairs: int = 4, kv_lora_rank: int = 48, mla_d_kv: int = 16, **kwargs
    ):
        self.mla_rope_pairs = int(mla_rope_pairs)
        self.kv_lora_rank = int(kv_lora_rank)
        self.mla_d_kv = int(mla_d_kv)
        kwargs.setdefault(
            "auto_map",
            {
                "AutoConfig": "configuration_mla.MLAConfig",
                "AutoModelForCausalLM": "modeling_mla.MLAForCausalLM",
            },
        )
        super().__init__(**kwargs)
