"""Formats of converted attention (``compress.methods.attn``) for transformers.

Each kind has a config and a modeling file that import only transformers, so a run folder
carries copies of them with an ``auto_map`` (``trust_remote_code=True`` loads it anywhere).
``register()`` makes this process's transformers Auto classes know the model types without
running a folder's code.
"""

from pathlib import Path

from .configuration_cla import CLAConfig
from .configuration_mla import MLAConfig
from .modeling_cla import CLAForCausalLM
from .modeling_mla import MLAForCausalLM

HERE = Path(__file__).parent
KINDS = {  # model_type -> (config class, model class, files a run folder carries)
    CLAConfig.model_type: (CLAConfig, CLAForCausalLM, ("configuration_cla.py", "modeling_cla.py")),
    MLAConfig.model_type: (MLAConfig, MLAForCausalLM, ("configuration_mla.py", "modeling_mla.py")),
}


def register() -> None:
    """Register the converted model types with transformers' AutoConfig / AutoModelForCausalLM."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    for model_type, (config_cls, model_cls, _) in KINDS.items():
        if model_type not in CONFIG_MAPPING:
            AutoConfig.register(model_type, config_cls)
            AutoModelForCausalLM.register(config_cls, model_cls)


def converted_config(config_cls, source, **fields):
    """A ``config_cls`` with every field of the Llama-family ``source`` config, plus ``fields``."""
    skip = ("model_type", "architectures", "auto_map", "transformers_version")
    return config_cls(**{k: v for k, v in source.to_dict().items() if k not in skip}, **fields)


def folder_files(model_type: str) -> dict[str, Path]:
    """``{name in the run folder: file to copy}`` for a converted model type."""
    return {name: HERE / name for name in KINDS[model_type][2]}


register()
