"""The formats layer: its registry, and the one-way dependencies methods -> formats <- kernels."""

import json
import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn

from compress.errors import CompressError
from compress.formats import compressed_tensors as ct
from compress.layers import LAYERS, Int8Linear, QuantLinear, group_params, quantized_layer

METHOD_PACKAGES = (
    "compress.methods.quant",
    "compress.methods.prune",
    "compress.methods.distill",
    "compress.decoder",
    "compress.recipe.pipeline",
    "compress.io.source",
    "compress.io.checkpoint",
)


def modules_after(code: str) -> list[str]:
    """The ``compress`` modules a fresh interpreter has loaded after running ``code``."""
    script = textwrap.dedent(code) + textwrap.dedent("""
        import json, sys
        print(json.dumps(sorted(m for m in sys.modules if m.startswith("compress"))))
    """)
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])


def test_formats_import_no_method_package():
    """Building both layers and running their forwards (kernels included) loads no method."""
    loaded = modules_after("""
        import torch
        from compress.layers import Int8Linear, QuantLinear, quantized_layer
        lin = torch.nn.Linear(64, 32)
        for qcfg in ({"quant_method": "awq", "bits": 4, "group_size": 32},
                     {"quant_method": "compress", "bits": 3, "group_size": 32},
                     {"quant_method": "bitsandbytes"}):
            layer = quantized_layer(qcfg, lin)
            layer(torch.randn(2, 64))
    """)
    assert "compress.layers" in loaded and "compress.kernels.cpu" in loaded
    assert "compress.kernels.int8_cpu" in loaded
    assert not [m for m in loaded if m.startswith(METHOD_PACKAGES)]


def test_kernels_import_no_method_package():
    """Every module of compress.kernels (Triton ones included) imports no method package."""
    loaded = modules_after("""
        import os, pkgutil, importlib
        os.environ["TRITON_INTERPRET"] = "1"
        import compress.kernels as k
        for info in pkgutil.iter_modules(k.__path__):
            importlib.import_module(f"compress.kernels.{info.name}")
    """)
    assert {"compress.kernels.packkv_triton", "compress.kernels.dequant_matmul"} <= set(loaded)
    assert not [m for m in loaded if m.startswith(METHOD_PACKAGES)]


@pytest.mark.parametrize(
    "qcfg,cls",
    [
        ({"quant_method": "awq", "bits": 4, "group_size": 32, "version": "gemm"}, QuantLinear),
        ({"quant_method": "compress", "bits": 3, "group_size": 64}, QuantLinear),
        ({"quant_method": "bitsandbytes", "llm_int8_threshold": 4.5}, Int8Linear),
        (ct.quantization_config(3, 64), QuantLinear),
    ],
)
def test_registry_builds_the_layer_of_each_quant_method(qcfg, cls):
    lin = nn.Linear(128, 64, bias=True)
    layer = quantized_layer(qcfg, lin, "model.layers.0.mlp.up_proj")
    assert type(layer) is cls
    assert set(LAYERS) == {"awq", "compress", "compressed-tensors", "bitsandbytes"}
    assert (layer.in_features, layer.out_features) == (128, 64)
    assert layer.bias is not None and layer.bias.shape == (64,)
    if cls is QuantLinear:
        assert (layer.bits, layer.group_size) == group_params(qcfg)
        assert layer.format == ("awq" if layer.bits == 4 else "compress")
        names = {n for n, _ in layer.named_buffers()}
        assert ("qweight" in names) == (layer.bits == 4)
    else:
        assert layer.threshold == 4.5 and layer.name == "model.layers.0.mlp.up_proj"
        assert layer.weight.dtype == torch.int8 and layer.SCB.dtype == torch.float32


def test_registry_rejects_unknown_quant_method():
    with pytest.raises(
        CompressError,
        match=r"unknown quant_method 'gptq'.*'awq', 'compress', 'compressed-tensors' and "
        r"'bitsandbytes'",
    ):
        quantized_layer({"quant_method": "gptq", "bits": 4}, nn.Linear(64, 32))
