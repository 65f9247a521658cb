"""The Python API: compress.run (a recipe into a run folder) and compress.quantize (in memory)."""

import json
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

import compress
from compress.arch.adapters import get_adapter
from compress.errors import CompressError
from compress.formats.quantizer import quantize as rtn_reference
from compress.io.checkpoint import load_run
from compress.layers import group_params
from tests.conftest import ROOT, make_tiny_model

TINY = {"eval": {"windows": 2, "seqlen": 64}, "calib": {"samples": 4, "seqlen": 64}}


def test_import_compress_loads_no_heavy_library():
    code = (
        "import sys, compress; heavy = ('torch', 'transformers', 'hydra', 'omegaconf'); "
        "print(sorted({m.split('.')[0] for m in sys.modules} & set(heavy)))"
    )
    res = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60
    )
    assert res.returncode == 0 and res.stdout.strip() == "[]", res.stdout + res.stderr
    assert compress.RTNConfig is compress.api.RTNConfig and "run" in compress.__all__


def test_run_returns_folder_and_report(tiny_dir, tmp_path):
    result = compress.run(
        "rtn_int4",
        "decode.new_tokens=16",
        model=tiny_dir,
        out=tmp_path / "run",
        rtn={"group_size": 64},
        **TINY,
    )
    assert result.path == tmp_path / "run"
    assert result.report == json.loads((result.path / "report.json").read_text())
    assert (
        result.report["bits"] == 4
        and result.report["group_size"] == 64
        and result.report["ppl_windows"] == 2
    )
    manifest = json.loads((result.path / "manifest.json").read_text())
    assert (
        manifest["source"]["path"] == str(tiny_dir)
        and manifest["recipe"]["rtn"]["group_size"] == 64
    )


def test_run_checks_settings_before_work(tiny_dir, tmp_path):
    with pytest.raises(
        CompressError, match="unknown key 'eval.windowz'.*did you mean eval.windows"
    ):
        compress.run("fp", model=tiny_dir, out=tmp_path / "run", eval={"windowz": 2})
    with pytest.raises(CompressError, match="eval.windows takes an integer"):
        compress.run("fp", model=tiny_dir, out=tmp_path / "run", eval={"windows": "two"})
    with pytest.raises(CompressError, match="does not exist"):
        compress.run("fp", model=tmp_path / "absent", out=tmp_path / "run")
    assert not (tmp_path / "run").exists()


def test_override_values_round_trip_through_hydra():
    from compress.api import overrides_of
    from compress.recipe.overrides import compose

    odd = "it's a \\path with spaces, \\'quotes\\"
    cfg = compose(
        "minitron_width",
        overrides_of(
            {
                "prune": {"axes": ["hidden_size"], "target_params": 0.5, "cache": False},
                "distill": {"data": odd},
                "eval": {"windows": None},
                "seed": 3,
            }
        ),
    )
    assert list(cfg.prune.axes) == ["hidden_size"] and cfg.prune.target_params == 0.5
    assert (
        cfg.prune.cache is False
        and cfg.distill.data == odd
        and cfg.eval.windows is None
        and cfg.seed == 3
    )


def test_quantize_rtn_in_memory_then_save_and_load(tmp_path, tokenizer):
    model = make_tiny_model()
    source = {
        name: lin.weight.detach().clone()
        for name, lin in get_adapter(model.config).all_linears(model).items()
    }
    x = torch.randint(0, 49152, (1, 16), generator=torch.Generator().manual_seed(1))

    assert compress.quantize(model, compress.RTNConfig(bits=4, group_size=64)) is model
    for name, layer in get_adapter(model.config).all_linears(model).items():
        assert torch.equal(layer.dequantize(), rtn_reference(source[name], 4, 64).dequantize()), (
            name
        )
    assert model.config.quantization_config["quant_method"] == "compressed-tensors"
    assert group_params(model.config.quantization_config) == (4, 64)

    compress.save(model, tmp_path / "q", tokenizer=tokenizer)
    loaded, tok = load_run(tmp_path / "q")
    assert tok is not None
    with torch.no_grad():
        for p in model.parameters():  # the checkpoint holds the unquantized tensors in float16
            p.copy_(p.half().float())
        assert torch.equal(loaded(x).logits, model(x).logits)
    with pytest.raises(CompressError, match="already quantized"):
        compress.quantize(model, compress.RTNConfig())
    with pytest.raises(CompressError, match="already exists"):
        compress.save(model, tmp_path / "q")


def test_quantize_refuses_bad_settings_before_work():
    model = make_tiny_model()
    with pytest.raises(
        CompressError,
        match=r"group size 256 does not divide layer 'model\.layers\.0\.self_attn\.q_proj "
        r"\[128x128\]'",
    ):
        compress.quantize(model, compress.RTNConfig(group_size=256))
    with pytest.raises(CompressError, match="calibrates on text: pass tokenizer"):
        compress.quantize(model, compress.AWQConfig())
    with pytest.raises(CompressError, match="unknown key 'awq.n_gird'.*did you mean awq.n_grid"):
        compress.quantize(model, compress.AWQConfig(options={"n_gird": 4}))
    assert isinstance(model.model.layers[0].self_attn.q_proj, torch.nn.Linear)  # untouched


@pytest.mark.parametrize(
    "recipe, config",
    [
        ("awq_int4", compress.AWQConfig(calib_samples=4, calib_seqlen=64)),
        ("gptq_int4", compress.GPTQConfig(calib_samples=4, calib_seqlen=64)),
        ("llm_int8", compress.Int8Config(threshold=6.0)),
    ],
)
def test_quantize_equals_the_recipe_run(recipe, config, tiny_dir, tmp_path, tokenizer):
    """quantize() with a recipe's settings writes the tensors the recipe's run folder holds."""
    extra = {"llm_int8": {"outlier_stats": False}} if recipe == "llm_int8" else {}
    compress.run(
        recipe, model=tiny_dir, out=tmp_path / "run", decode={"enabled": False}, **extra, **TINY
    )
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_dir).eval()
    compress.quantize(model, config, tokenizer=tokenizer)
    compress.save(model, tmp_path / "api", tokenizer=tokenizer)
    ours, theirs = (load_file(str(tmp_path / d / "model.safetensors")) for d in ("api", "run"))
    assert ours.keys() == theirs.keys()
    for name in theirs:
        assert torch.equal(ours[name], theirs[name]), name
    run_config = json.loads((tmp_path / "run" / "config.json").read_text())["quantization_config"]
    assert (
        json.loads((tmp_path / "api" / "config.json").read_text())["quantization_config"]
        == run_config
    )
