"""The recipe pipeline end to end on a tiny model, and every user-facing error."""

import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from compress.__main__ import rewrite_argv
from compress.errors import CompressError
from compress.eval.perplexity import evaluate
from compress.formats import compressed_tensors as ct
from compress.formats.awq_gemm import unpack_awq
from compress.formats.quantizer import quantize
from compress.io.checkpoint import load_run
from compress.recipe.pipeline import run
from tests.conftest import DATA, ROOT, TINY_OVERRIDES, compose


def run_recipe(recipe, tiny_dir, out, *extra):
    cfg = compose(recipe, [f"model.path={tiny_dir}", *TINY_OVERRIDES, *extra])
    return run(cfg, out)


def test_rtn_int4_run_folder(tiny_dir, tmp_path):
    out = tmp_path / "run"
    run_recipe("rtn_int4", tiny_dir, out)
    names = {p.name for p in out.iterdir()}
    assert {
        "config.json",
        "model.safetensors",
        "manifest.json",
        "report.json",
        "report.md",
    } <= names
    assert not [
        p for p in tmp_path.iterdir() if p.name.startswith(".run.tmp")
    ]  # temp folder renamed

    qcfg = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qcfg == ct.quantization_config(4, 128)
    assert qcfg["config_groups"]["group_0"]["weights"]["num_bits"] == 4
    # the saved tensors decode, by the format's own library, to RTN of the source weights
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32
    from transformers import AutoModelForCausalLM

    src = AutoModelForCausalLM.from_pretrained(tiny_dir)
    t = load_file(str(out / "model.safetensors"))
    w = src.model.layers[1].mlp.down_proj.weight.data
    qw = quantize(w, 4, 128)
    p = "model.layers.1.mlp.down_proj."
    assert t[p + "weight_packed"].dtype == torch.int32
    assert t[p + "weight_packed"].shape == (128, 256 * 4 // 32)
    assert t[p + "weight_shape"].tolist() == [128, 256]
    signed = unpack_from_int32(t[p + "weight_packed"], 4, torch.Size([128, 256]))
    assert torch.equal(signed.int() + 8, qw.q)
    zeros = unpack_from_int32(t[p + "weight_zero_point"], 4, torch.Size([128, 2]), packed_dim=0)
    assert torch.equal(zeros.int() + 8, qw.zeros)
    assert torch.equal(t[p + "weight_scale"], qw.scales)

    assert "lm_head.weight" not in t  # tied to the embeddings

    saved = json.loads((out / "report.json").read_text())
    for key in (
        "recipe",
        "model",
        "ppl",
        "ppl_windows",
        "seqlen",
        "kl_vs_source",
        "top1_vs_source",
        "weight_bytes",
        "elapsed_s",
        "stages",
        "decode_tok_s",
        "prefill_tok_s",
        "kv_bytes_per_token",
    ):
        assert key in saved, key
    assert saved["group_size"] == 128 and saved["bits"] == 4 and saved["ppl_windows"] == 2
    # the built-in decoder ran the folder: fp16 cache, 2 layers x (K + V) x 2 kv heads x 32 dims x 2 bytes
    assert saved["kv_bytes_per_token"] == 2 * 2 * 2 * 32 * 2
    assert saved["decode_tok_s"] > 0 and saved["prefill_tok_s"] > 0 and "decode" in saved["stages"]
    assert "| decode_tok_s |" in (out / "report.md").read_text()
    manifest = json.loads((out / "manifest.json").read_text())
    assert set(manifest["files"]) == names - {"manifest.json"}
    from compress.io.run_folder import sha256_file

    for name, entry in manifest["files"].items():
        assert entry["bytes"] == (out / name).stat().st_size
        assert entry["sha256"] == sha256_file(out / name)
    assert manifest["recipe"]["rtn"]["bits"] == 4 and "rtn" in manifest["stages"]


def test_rtn_int4_autoawq_format(tiny_dir, tmp_path):
    """``quant.format=autoawq``: AutoAWQ's GEMM layout, as transformers' AWQ loader reads it."""
    out = tmp_path / "run"
    run_recipe("rtn_int4", tiny_dir, out, "quant.format=autoawq", "decode.enabled=false")
    qcfg = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qcfg == {
        "quant_method": "awq",
        "bits": 4,
        "group_size": 128,
        "zero_point": True,
        "version": "gemm",
        "modules_to_not_convert": None,
    }
    from transformers import AutoModelForCausalLM

    src = AutoModelForCausalLM.from_pretrained(tiny_dir)
    t = load_file(str(out / "model.safetensors"))
    qw = quantize(src.model.layers[1].mlp.down_proj.weight.data, 4, 128)
    p = "model.layers.1.mlp.down_proj."
    assert t[p + "qweight"].dtype == torch.int32 and t[p + "qweight"].shape == (256, 128 // 8)
    assert torch.equal(unpack_awq(t[p + "qweight"]), qw.q.t())
    assert torch.equal(unpack_awq(t[p + "qzeros"]), qw.zeros.t())
    assert torch.equal(t[p + "scales"], qw.scales.t())


def test_packed_checkpoint_equals_fake_quant(tiny_dir, tmp_path, tokenizer):
    """Perplexity of the loaded packed checkpoint = perplexity of the in-memory fake-quant model."""
    from transformers import AutoModelForCausalLM

    from compress.arch.adapters import get_adapter
    from compress.formats.quantizer import fake_quantize

    run_recipe("rtn_int3", tiny_dir, tmp_path / "run")
    packed, _ = load_run(tmp_path / "run")
    fake = AutoModelForCausalLM.from_pretrained(tiny_dir).eval()
    linears = get_adapter(fake.config).all_linears(fake).values()
    with torch.no_grad():  # the folder holds the embedding and norms in float16
        for p in set(fake.parameters()) - {lin.weight for lin in linears}:
            p.copy_(p.half().float())
    for lin in linears:
        lin.weight.data = fake_quantize(lin.weight.data, 3, 128)
    windows = torch.randint(0, 49152, (2, 64), generator=torch.Generator().manual_seed(0))
    a, b = evaluate(packed, windows), evaluate(fake, windows)
    assert abs(a["ppl"] - b["ppl"]) / b["ppl"] < 1e-5


def test_fp_recipe_kl_is_zero(tiny_dir, tmp_path):
    report = run_recipe("fp", tiny_dir, tmp_path / "run")
    assert report["kl_vs_source"] < 1e-6 and report["top1_vs_source"] == 1.0
    assert "quantization_config" not in json.loads((tmp_path / "run" / "config.json").read_text())


def test_cli_end_to_end(tiny_dir, tmp_path):
    env = dict(os.environ, COMPRESS_DATA_DIR=str(DATA))
    out = tmp_path / "cli"
    args = [
        sys.executable,
        "-m",
        "compress",
        "recipe=rtn_int8",
        f"model.path={tiny_dir}",
        *TINY_OVERRIDES,
        f"hydra.run.dir={out}",
    ]
    res = subprocess.run(args, capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    report = json.loads((out / "report.json").read_text())
    assert report["recipe"] == "rtn_int8" and report["bits"] == 8
    res = subprocess.run(
        [sys.executable, "-m", "compress", "recipe=rtn_int4", "--cfg", "job"],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=120,
    )
    assert res.returncode == 0 and str(DATA) in res.stdout  # resolved, not ${oc.env:...}
    assert "group_size: auto" in res.stdout


def test_cli_unknown_recipe_is_one_clean_paragraph():
    res = subprocess.run(
        [sys.executable, "-m", "compress", "recipe=awq_int9"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert res.returncode == 2
    assert "unknown recipe 'awq_int9'" in res.stderr and "rtn_int4" in res.stderr
    assert "Traceback" not in res.stderr


# ---- errors: each names the problem and the fix -------------------------------------------


def test_error_unknown_recipe_lists_available():
    with pytest.raises(CompressError, match="unknown recipe 'nope'.*fp.*rtn_int4"):
        rewrite_argv(["recipe=nope"])


def test_error_unknown_model_config():
    with pytest.raises(
        CompressError, match="unknown model config 'llama-9t'.*smollm2-135m.*model.path"
    ):
        rewrite_argv(["recipe=fp", "model=llama-9t"])


def refuse_model_load(monkeypatch):
    """Make the pipeline's model loading fail the test: the error must come before any work."""
    import compress.recipe.pipeline as pipeline

    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded before the config error")

    monkeypatch.setattr(pipeline, "load_model", refuse)


@pytest.fixture
def no_model_load(monkeypatch):
    refuse_model_load(monkeypatch)


def test_error_quantized_model_path(tiny_dir, tmp_path, monkeypatch):
    run_recipe("rtn_int4", tiny_dir, tmp_path / "q", "decode.enabled=false")
    refuse_model_load(monkeypatch)
    with pytest.raises(
        CompressError,
        match=rf"'{tmp_path}/q' is already quantized \(quant_method "
        rf"'compressed-tensors', 4 bits\).*source model instead \(this folder was made from "
        rf"'{tiny_dir}'\)",
    ):
        run_recipe("awq_int4", tmp_path / "q", tmp_path / "run")
    assert not (tmp_path / "run").exists()


def test_recipes_compose_on_a_run_folder(tiny_dir, tmp_path):
    """An unquantized run folder (fp here; pruned ones alike) is a source: rtn_int4 runs on it and
    its weights are RTN of the folder's weights."""
    from transformers import AutoModelForCausalLM

    run_recipe("fp", tiny_dir, tmp_path / "fp", "decode.enabled=false")
    report = run_recipe("rtn_int4", tmp_path / "fp", tmp_path / "q", "decode.enabled=false")
    assert report["bits"] == 4
    manifest = json.loads((tmp_path / "q" / "manifest.json").read_text())
    assert manifest["source"]["path"] == str(tmp_path / "fp")
    w = AutoModelForCausalLM.from_pretrained(tmp_path / "fp").model.layers[0].mlp.up_proj.weight
    layer = load_run(tmp_path / "q")[0].model.layers[0].mlp.up_proj
    assert torch.equal(layer.dequantize(), quantize(w.data, 4, 128).dequantize())


def test_error_missing_model_path(tmp_path):
    with pytest.raises(CompressError, match="does not exist.*model.path"):
        run(compose("fp", [f"model.path={tmp_path}/absent"]), tmp_path / "run")
    assert not (tmp_path / "run").exists()


def test_error_unsupported_architecture(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=100)).save_pretrained(
        tmp_path / "gpt2"
    )
    with pytest.raises(CompressError, match="unsupported architecture 'gpt2'.*llama"):
        run(compose("fp", [f"model.path={tmp_path}/gpt2"]), tmp_path / "run")


def test_error_group_size_names_layer(tiny_dir, tmp_path, no_model_load):
    """Checked from config.json before the model loads: 256 divides no 128-wide layer."""
    with pytest.raises(
        CompressError,
        match=r"group size 256 does not divide layer "
        r"'model\.layers\.0\.self_attn\.q_proj \[128x128\]'",
    ):
        run_recipe("rtn_int4", tiny_dir, tmp_path / "run", "rtn.group_size=256")
    with pytest.raises(CompressError, match=r"rtn.group_size=96: .*-1.*power of two"):
        run_recipe("rtn_int4", tiny_dir, tmp_path / "run", "rtn.group_size=96")
    with pytest.raises(CompressError, match=r"awq.bits=9: .*from 2 to 8"):
        run_recipe("awq_int4", tiny_dir, tmp_path / "run", "awq.bits=9")
    assert not (tmp_path / "run").exists()


def test_error_missing_data_names_env(tiny_dir, tmp_path, no_model_load):
    with pytest.raises(CompressError, match="COMPRESS_DATA_DIR"):
        run_recipe(
            "rtn_int4",
            tiny_dir,
            tmp_path / "run",
            f"data.eval.source={tmp_path}/none/wiki.test.raw",
        )
    with pytest.raises(CompressError, match="calib file .*not found"):  # AWQ calibrates
        run_recipe("awq_int4", tiny_dir, tmp_path / "run", f"data.calib.source={tmp_path}/no.txt")
    unset = compose("fp", [f"model.path={tiny_dir}"])
    unset.data.eval.source = "./COMPRESS_DATA_DIR-unset/wikitext-2/wiki.test.raw"  # as data/*.yaml
    with pytest.raises(CompressError, match=r"not found \(COMPRESS_DATA_DIR is not set\)"):
        run(unset, tmp_path / "run")
    assert not (tmp_path / "run").exists() and not list(tmp_path.glob(".run.tmp*"))


def test_error_corrupt_safetensors(tiny_dir, tmp_path):
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(tiny_dir, bad)
    data = (bad / "model.safetensors").read_bytes()
    (bad / "model.safetensors").write_bytes(data[: len(data) // 2])  # truncated
    with pytest.raises(CompressError, match="corrupt or truncated"):
        run(compose("fp", [f"model.path={bad}", "eval.seqlen=64"]), tmp_path / "run")
    with pytest.raises(CompressError, match="corrupt or truncated"):
        load_run(bad)


def test_error_nan_weight(tiny_dir, tmp_path):
    import shutil

    bad = tmp_path / "nan"
    shutil.copytree(tiny_dir, bad)
    t = load_file(str(bad / "model.safetensors"))
    t["model.layers.1.mlp.up_proj.weight"][3, 5] = float("nan")
    save_file(t, str(bad / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CompressError, match="model.layers.1.mlp.up_proj.weight.*NaN or inf"):
        run(compose("fp", [f"model.path={bad}", "eval.seqlen=64"]), tmp_path / "run")


def test_error_run_folder_shape_mismatch(tiny_dir, tmp_path):
    run_recipe("rtn_int4", tiny_dir, tmp_path / "run")
    t = load_file(str(tmp_path / "run" / "model.safetensors"))
    name = "model.layers.0.self_attn.k_proj.weight_scale"
    t[name] = t[name][:8].contiguous()
    save_file(t, str(tmp_path / "run" / "model.safetensors"))
    with pytest.raises(CompressError, match=r"k_proj.weight_scale.*expects \(64, 1\)"):
        load_run(tmp_path / "run", verify=False)  # past the manifest's check, which refuses it


def test_error_existing_run_folder(tiny_dir, tmp_path):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "x").write_text("keep me")
    with pytest.raises(CompressError, match="already exists"):
        run_recipe("fp", tiny_dir, tmp_path / "run")
    assert (tmp_path / "run" / "x").read_text() == "keep me"


def test_interrupted_run_leaves_nothing(tiny_dir, tmp_path, monkeypatch):
    import compress.recipe.pipeline as pipeline

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(pipeline, "evaluate", interrupted)  # after the checkpoint was written
    (tmp_path / "run").mkdir()  # Hydra's placeholder
    with pytest.raises(KeyboardInterrupt):
        run_recipe("rtn_int4", tiny_dir, tmp_path / "run")
    assert list(tmp_path.iterdir()) == []


def test_rtn_per_row_group(tiny_dir, tmp_path):
    """rtn.group_size=-1 saves one scale per row; the loaded layers decode to per-row RTN."""
    from transformers import AutoModelForCausalLM

    run_recipe("rtn_int8", tiny_dir, tmp_path / "run", "rtn.group_size=-1")
    qcfg = json.loads((tmp_path / "run" / "config.json").read_text())["quantization_config"]
    weights = qcfg["config_groups"]["group_0"]["weights"]  # compressed-tensors' per-row scheme
    assert weights["strategy"] == "channel" and weights["group_size"] is None
    assert weights["num_bits"] == 8
    packed, _ = load_run(tmp_path / "run")
    src = AutoModelForCausalLM.from_pretrained(tiny_dir)
    w = src.model.layers[0].mlp.down_proj.weight.data
    layer = packed.model.layers[0].mlp.down_proj
    assert layer.scales.shape == (1, w.shape[0])
    assert torch.equal(layer.dequantize(), quantize(w, 8, w.shape[1]).dequantize())


def test_awq_refuses_per_row_group(tiny_dir, tmp_path):
    with pytest.raises(CompressError, match="group_size=-1"):
        run_recipe("awq_int4", tiny_dir, tmp_path / "run", "awq.group_size=-1")
    assert not (tmp_path / "run").exists()


def test_decoder_figures_and_errors(tiny_dir, tmp_path, monkeypatch):
    with pytest.raises(CompressError, match="decode.kv=bogus"):
        run_recipe("fp", tiny_dir, tmp_path / "bad", "decode.kv=bogus")
    assert not (tmp_path / "bad").exists()
    report = run_recipe(
        "rtn_int4", tiny_dir, tmp_path / "packkv", "decode.kv=packkv", "decode.new_tokens=200"
    )
    assert (
        0 < report["kv_bytes_per_token"] < 2 * 2 * 2 * 32 * 2
    )  # compressed below the fp16 cache's

    from compress.recipe import pipeline

    def refuse(*a, **k):
        raise CompressError("this architecture is not in the decoder")

    monkeypatch.setattr(pipeline, "measure", refuse)  # compress.eval.decode_speed's
    report = run_recipe("fp", tiny_dir, tmp_path / "nodecoder")
    assert (
        report["decode_error"] == "this architecture is not in the decoder"
        and "decode_tok_s" not in report
    )
    assert (tmp_path / "nodecoder" / "report.json").exists()
