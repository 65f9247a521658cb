"""compress: model compression for LLMs, checkpoint -> stages -> run folder -> decoder -> report.

The Python API (``compress/api.py``), imported on first use so ``import compress`` stays fast::

    result = compress.run("awq_int4", model="FOLDER_OR_HUB_ID", eval={"windows": 4})
    compress.quantize(model, compress.RTNConfig(bits=4, group_size=128))
    model, tokenizer, runtime = compress.load("outputs/awq_int4")  # the decoder's configuration
"""

from compress.version import __version__

_API = (
    "run",
    "quantize",
    "save",
    "load",
    "RunResult",
    "RTNConfig",
    "AWQConfig",
    "GPTQConfig",
    "Int8Config",
)
__all__ = ["__version__", *_API]


def __getattr__(name: str):
    if name in _API:
        from compress import api  # lazy: `import compress` loads no torch

        return getattr(api, name)
    raise AttributeError(f"module 'compress' has no attribute '{name}'")
