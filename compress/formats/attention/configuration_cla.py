"""Config of a cross-layer-attention (CLA) Llama: Brandon et al. 2024, arXiv 2405.12981.

A Llama config plus ``cla_share`` (s): layer i attends with the K/V that layer ``i - i % s``
(the first layer of its group) computed and cached; the other layers of the group have no
``k_proj``/``v_proj`` and cache nothing. Self-contained (transformers only), so a run folder
can carry it for ``trust_remote_code=True``.
"""

from transformers import LlamaConfig


class CLAConfig(LlamaConfig):
    model_type = "compress_cla"

    def __init__(self, cla_share: int = 2, **kwargs):
        self.cla_share = int(cla_share)
        kwargs.setdefault(
            "auto_map",
            {
                "AutoConfig": "configuration_cla.CLAConfig",
                "AutoModelForCausalLM": "modeling_cla.CLAForCausalLM",
            },
        )
        super().__init__(**kwargs)

    def kv_layer(self, layer: int) -> int:
        """The layer whose K/V ``layer`` attends with."""
        return layer - layer % self.cla_share
