"""The minitron_width and minitron_depth recipes end to end on a tiny model."""

import json
import os
import subprocess
import sys

import pytest
import torch

from compress.errors import CompressError
from compress.io.checkpoint import load_run
from compress.methods.prune.prune import param_total
from compress.recipe.pipeline import run
from tests.conftest import DATA, ROOT, TINY_OVERRIDES, compose

DISTILL = [
    "distill.tokens=64",
    "distill.seqlen=32",
    "distill.grad_accum=1",
    "distill.checkpoint_every=1",
]


def run_recipe(recipe, tiny_dir, out, *extra):
    return run(compose(recipe, [f"model.path={tiny_dir}", *TINY_OVERRIDES, *DISTILL, *extra]), out)


def test_width_recipe(tiny_dir, tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM

    import compress.methods.prune.importance as imp

    monkeypatch.setenv("COMPRESS_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "run"
    report = run_recipe("minitron_width", tiny_dir, out)
    config = json.loads((out / "config.json").read_text())
    # 0.763 of 6.59M parameters, 6.29M of them the embedding: hidden 128 -> 96, MLP kept
    assert (
        config["hidden_size"],
        config["intermediate_size"],
        config["num_hidden_layers"],
        config["head_dim"],
    ) == (96, 256, 2, 32)
    assert "quantization_config" not in config
    saved = json.loads((out / "report.json").read_text())
    assert saved["distill_tokens"] == 64 and saved["distill"]["steps"] == 2
    assert 0.97 * 0.763 <= saved["params"] / saved["source_params"] <= 0.763
    assert saved["prune"]["sizes"]["hidden_size"] == 96
    assert {"prune", "distill", "export", "eval"} <= set(saved["stages"])
    assert (out / "importance" / "scores.safetensors").is_file()
    assert (
        "importance/scores.safetensors" in json.loads((out / "manifest.json").read_text())["files"]
    )
    assert not (
        tmp_path / ".run.distill"
    ).exists()  # checkpoints removed once distillation completed

    hf = AutoModelForCausalLM.from_pretrained(out).eval()
    ours, _ = load_run(out)
    assert param_total(hf) == saved["params"] and hf.lm_head.weight is hf.model.embed_tokens.weight
    x = torch.randint(0, 49152, (1, 16))
    with torch.no_grad():
        assert torch.equal(hf(x).logits, ours(x).logits)

    # re-pruning to another size reads the cached scores instead of calibrating again
    monkeypatch.setattr(
        imp, "activation_importance", lambda *a, **k: pytest.fail("calibrated again")
    )
    report = run_recipe(
        "minitron_width",
        tiny_dir,
        tmp_path / "run2",
        "prune.target_params=null",
        "prune.export.intermediate_size=128",
        "distill.tokens=0",
    )
    assert report["distill_tokens"] == 0 and report["prune"]["sizes"]["intermediate_size"] == 128
    assert report["params"] == saved["source_params"] - 2 * 3 * 128 * 128


def test_depth_recipe_cli(tiny_dir, tmp_path):
    env = dict(os.environ, COMPRESS_DATA_DIR=str(DATA), COMPRESS_CACHE=str(tmp_path / "cache"))
    out = tmp_path / "cli"
    args = [
        sys.executable,
        "-m",
        "compress",
        "recipe=minitron_depth",
        f"model.path={tiny_dir}",
        *TINY_OVERRIDES,
        "prune.export.num_hidden_layers=1",
        "distill.tokens=0",
        f"hydra.run.dir={out}",
    ]
    res = subprocess.run(args, capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    report = json.loads((out / "report.json").read_text())
    assert report["recipe"] == "minitron_depth" and report["distill_tokens"] == 0
    assert (
        report["prune"]["sizes"]["num_hidden_layers"] == 1
        and len(report["prune"]["kept_layers"]) == 1
    )
    model, _ = load_run(out)
    assert model.config.num_hidden_layers == 1 and param_total(model) == report["params"]


def test_error_heads_through_the_pipeline(tiny_dir, tmp_path):
    with pytest.raises(
        CompressError, match=r"num_attention_heads=3 .*valid head counts are 2, 4; nearest: 2 or 4"
    ):
        run_recipe(
            "minitron_depth",
            tiny_dir,
            tmp_path / "run",
            "prune.export.num_hidden_layers=1",
            "prune.export.num_attention_heads=3",
        )
    assert not (tmp_path / "run").exists()


def test_error_resume_from_another_recipe(tiny_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("COMPRESS_CACHE", str(tmp_path / "cache"))
    ckpt = f"distill.checkpoint_dir={tmp_path / 'ckpt'}"
    run_recipe(
        "minitron_depth",
        tiny_dir,
        tmp_path / "a",
        "prune.export.num_hidden_layers=1",
        ckpt,
        "distill.keep_checkpoints=true",
    )
    assert (tmp_path / "ckpt" / "step-00000001").is_dir()
    with pytest.raises(
        CompressError,
        match=r"belongs to another run .*recipe: 'minitron_depth' in the checkpoint, "
        r"'minitron_width' now",
    ):
        run_recipe("minitron_width", tiny_dir, tmp_path / "b", ckpt)
    assert not (tmp_path / "b").exists()


def test_depth_by_perplexity_drop(tiny_dir, tmp_path, monkeypatch):
    from compress.methods.prune.importance import load_scores

    monkeypatch.setenv("COMPRESS_CACHE", str(tmp_path / "cache"))
    report = run_recipe(
        "minitron_depth",
        tiny_dir,
        tmp_path / "run",
        "prune.export.num_hidden_layers=1",
        "prune.depth_metric=ppl",
        "prune.ppl_samples=2",
        "distill.tokens=0",
    )
    scores, meta = load_scores(tmp_path / "run" / "importance" / "scores.safetensors")
    assert meta["ppl_samples"] == 2 and scores["ppl_drop"].shape == (2,)
    assert report["prune"]["kept_layers"] == [int(scores["ppl_drop"].argmax())]
