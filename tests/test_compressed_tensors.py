"""The compressed-tensors format (pack-quantized): our packing against the format's own library,
our repacking to and from the kernels' layouts, and folders read both ways: GPTQ and AWQ runs of
every family loaded by stock transformers (no flags) against our decoder, and a folder the
compressed-tensors library wrote itself read by our decoder against transformers."""

import json

import pytest
import torch
from safetensors.torch import save_file

from compress.formats import compressed_tensors as ct
from compress.formats.quantizer import quantize
from compress.io.checkpoint import load_run
from compress.layers import QuantLinear
from compress.layers.codec import Codec
from tests.family_models import FAMILIES, family_model
from tests.test_methods_families import decoder_logits, hf_logits, rel_err, run_on, tokens

ct_lib = pytest.importorskip("compressed_tensors", reason="the hf extra: pip install -e '.[hf]'")


def bit_string_reference(q: torch.Tensor, bits: int) -> torch.Tensor:
    """Each row's codes written into one Python integer, ``bits`` apiece from bit 0, then cut
    into int32 words: the format's dense packing, spelled out."""
    rows = []
    for row in q.tolist():
        acc = sum(v << (bits * j) for j, v in enumerate(row))
        n = -(-len(row) * bits // 32)
        words = [(acc >> (32 * w)) & 0xFFFFFFFF for w in range(n)]
        rows.append([w - (1 << 32) if w >= 1 << 31 else w for w in words])
    return torch.tensor(rows, dtype=torch.int32)


@pytest.mark.parametrize("bits", range(2, 9))
@pytest.mark.parametrize("shape", [(5, 96), (3, 37)])
def test_packing_is_the_libraries(bits, shape):
    """Along either dimension, our packing equals compressed-tensors' ``pack_to_int32`` (which takes
    signed codes) and a bit-string reference, and unpacks back."""
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    q = torch.randint(0, 2**bits, shape, dtype=torch.int32)
    ref = bit_string_reference(q, bits)
    assert torch.equal(ct.pack(q, bits, 1), ref)
    assert torch.equal(ct.pack(q.t(), bits, 0), ref.t())
    for dim in (0, 1):
        theirs = pack_to_int32((q - 2 ** (bits - 1)).to(torch.int8), bits, packed_dim=dim)
        ours = ct.pack(q, bits, dim)
        assert torch.equal(ours, theirs), dim
        assert torch.equal(ct.unpack(ours, bits, shape[dim], dim), q)


@pytest.mark.parametrize("symmetric", [False, True], ids=["asym", "sym"])
@pytest.mark.parametrize("bits,group_size", [(4, 32), (3, 64), (8, -1), (5, 32)])
def test_codec_repacks_the_same_codes(bits, group_size, symmetric):
    """A layer stored as compressed-tensors and read back holds the same buffers, and the stored
    tensors dequantize, by the library's own decompressor, to our layer's weight."""
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationScheme

    w = torch.randn(64, 128, generator=torch.Generator().manual_seed(bits))
    layer = QuantLinear.from_quantized(quantize(w, bits, group_size, symmetric))
    qcfg = ct.quantization_config(bits, group_size, symmetric)
    model = torch.nn.Module()
    model.proj = layer
    codec = Codec(model, qcfg)
    stored = {
        n: read()
        for n, (_, _, read) in codec.encode("proj", lambda n: model.state_dict()[n]).items()
    }
    shapes = ct.shapes(64, 128, bits, layer.group_size, symmetric)
    assert {n.split(".")[-1]: tuple(t.shape) for n, t in stored.items()} == shapes
    back = codec.decode("proj", stored)
    for name, t in layer.state_dict().items():
        assert torch.equal(back[f"proj.{name}"], t), name
    scheme = QuantizationScheme.model_validate(qcfg["config_groups"]["group_0"])
    local = {n.split(".")[-1]: t for n, t in stored.items()}
    theirs = PackedQuantizationCompressor.decompress(local, scheme)["weight"]
    # (q - z) * s, one rounding to float16 in the library (the scale's dtype)
    assert torch.equal(theirs, layer.dequantize().half())


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("recipe", ["gptq_int4", "awq_int4"])
def test_folder_loads_in_stock_transformers(family, recipe, family_dirs, tmp_path):
    """A GPTQ and an AWQ run of every family, in the default format: ``from_pretrained`` with no
    flags and no remote code; every quantized linear holds our weight (one float16 rounding) and
    the float32 logits agree with our decoder's within 1e-3."""
    from transformers import AutoModelForCausalLM

    out = tmp_path / "run"
    extra = ["gptq.act_order=false"] if recipe == "gptq_int4" else []
    run_on(recipe, family_dirs[family], out, *extra)
    config = json.loads((out / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "compressed-tensors"
    hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()  # no flags
    ours, _ = load_run(out)
    quantized = {n: m for n, m in ours.named_modules() if isinstance(m, QuantLinear)}
    assert quantized
    for name, layer in quantized.items():
        theirs = hf.get_submodule(name).weight
        assert torch.equal(theirs, layer.dequantize().half().float()), name
    ids = tokens()
    assert rel_err(hf_logits(hf, ids), decoder_logits(out, ids)) < 1e-3


def test_int3_folder_loads_in_stock_transformers(family_dirs, tmp_path):
    """INT3 packs across word boundaries (ten and two-thirds codes per int32)."""
    from transformers import AutoModelForCausalLM

    out = tmp_path / "run"
    run_on("gptq_int3", family_dirs["llama"], out)
    hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ids = tokens()
    assert rel_err(hf_logits(hf, ids), decoder_logits(out, ids)) < 1e-3


def test_reads_a_folder_the_library_wrote(tmp_path, tokenizer):
    """llm-compressor's W4A16 preset (symmetric, no zero point, group 32), written by
    compressed-tensors' own compressor from an HF model: our decoder's logits agree with stock
    transformers' on the same folder, and the linears it ignores stay in floating point."""
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationScheme
    from transformers import AutoModelForCausalLM

    from compress.layers.codec import codec_for

    model = family_model("qwen3")
    qcfg = ct.quantization_config(4, 32, symmetric=True, ignore=["lm_head", "re:.*down_proj$"])
    scheme = QuantizationScheme.model_validate(qcfg["config_groups"]["group_0"])
    state = {k: v.detach().half() for k, v in model.state_dict().items()}
    for name, m in model.named_modules():
        if isinstance(m, torch.nn.Linear) and ct.scheme(qcfg, name) is not None:
            w = state.pop(f"{name}.weight").float()
            s = (w.reshape(w.shape[0], -1, 32).abs().amax(-1) / 7).half()
            local = {"weight": w.half(), "weight_scale": s}
            local = PackedQuantizationCompressor.compress(local, scheme)
            state.update({f"{name}.{k}": v.contiguous() for k, v in local.items()})
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    folder = tmp_path / "w4a16"
    folder.mkdir()
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    config = model.config.to_dict()
    config.update(quantization_config=qcfg, dtype="float16")
    (folder / "config.json").write_text(json.dumps(config))
    tokenizer.save_pretrained(folder)

    ours, _ = load_run(folder, verify=False)
    assert codec_for(ours, qcfg) is not None
    assert not isinstance(ours.model.layers[0].mlp.down_proj, QuantLinear)
    assert isinstance(ours.model.layers[0].mlp.up_proj, QuantLinear)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ids = tokens()
    assert rel_err(decoder_logits(folder, ids), hf_logits(hf, ids)) < 1e-3


@pytest.mark.parametrize("strategy", ["group", "channel"])
def test_a_scheme_without_the_symmetric_key_is_the_libraries_default(strategy):
    """A config whose weights leave out ``"symmetric"`` (the key is optional in
    compressed-tensors' ``QuantizationArgs``): read as the library reads it, symmetric (no zero
    point), whatever the config was first written as."""
    from compressed_tensors.quantization import QuantizationScheme

    for written in (False, True):
        qcfg = json.loads(json.dumps(ct.quantization_config(4, 32, written)))
        group = qcfg["config_groups"]["group_0"]
        del group["weights"]["symmetric"]
        if strategy == "channel":
            group["weights"].update(strategy="channel", group_size=None)
        theirs = QuantizationScheme.model_validate(group).weights
        assert theirs.symmetric is True  # the library's default
        ours = ct.scheme(qcfg, "model.layers.0.mlp.up_proj")
        assert ours == (4, 32 if strategy == "group" else -1, theirs.symmetric), written


def test_unsupported_schemes_are_refused_by_name():
    qcfg = ct.quantization_config(4, 128)
    with pytest.raises(Exception, match="pack-quantized"):
        ct.scheme({**qcfg, "format": "float-quantized"}, "model.layers.0.mlp.up_proj")
    act = json.loads(json.dumps(qcfg))
    act["config_groups"]["group_0"]["input_activations"] = {"num_bits": 8, "type": "int"}
    with pytest.raises(Exception, match="W4A16"):
        ct.scheme(act, "model.layers.0.mlp.up_proj")


@pytest.mark.parametrize("recipe", ["rtn_int4", "awq_int3", "gptq_int4"])
def test_an_unknown_format_is_refused_before_loading(recipe):
    from compress.errors import CompressError
    from compress.recipe.config import validate
    from tests.conftest import compose

    with pytest.raises(CompressError, match=r"quant.format='gguf'.*compressed-tensors.*autoawq"):
        validate(compose(recipe, ["quant.format=gguf"]))
