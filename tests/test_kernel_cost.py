"""``decode.kernel=w4a8``: the pipeline's evaluation also runs through the W4A8 kernel and
reports its cost; checked against the PyTorch arithmetic of the same kernel on the saved
folder."""

import json
import math

import pytest

from compress.decoder.runtime import FAST_KERNEL
from compress.eval.perplexity import evaluate
from compress.io.checkpoint import load_run
from compress.io.data import eval_windows, read_text
from compress.kernels.w4a8_cpu import use
from compress.layers.head import quantize_head
from tests.conftest import DATA
from tests.test_pipeline import run_recipe


@pytest.mark.slow
def test_pipeline_reports_the_kernel_cost(tiny_dir, tmp_path, monkeypatch, tokenizer):
    out = tmp_path / "run"
    report = run_recipe("rtn_int4", tiny_dir, out, "decode.kernel=w4a8", "quant.lm_head=int8")
    assert report["kernel"] == "w4a8" and report["kernel_layers"] == 2 * 7 + 1
    assert math.isclose(report["kernel_ppl_cost"], report["kernel_ppl"] / report["ppl"] - 1)
    assert report["kernel_ppl"] != report["ppl"] and abs(report["kernel_ppl_cost"]) < 0.05
    assert report["kernel_kl_vs_source"] > 0
    assert report["decode_config"]["kernel"] == "w4a8"
    assert report["decoder_default"] == dict(
        device="cpu", dtype="bfloat16", qdtype="bfloat16", kernel=FAST_KERNEL, head="int8", lean=True,
        compile=True, batch_invariant=False, threads=None, fast=True,
    )  # fmt: skip
    assert json.loads((out / "report.json").read_text())["kernel_ppl"] == report["kernel_ppl"]
    assert "w4a8" in (out / "README.md").read_text()
    # the same windows through the kernel's PyTorch arithmetic
    monkeypatch.setenv("COMPRESS_KERNELS", "ref")
    model = load_run(out)[0]
    quantize_head(
        model, "int8", json.loads((out / "config.json").read_text())["quantization_config"]
    )
    assert use(model, "w4a8") == report["kernel_layers"]
    text = read_text(str(DATA / "wikitext-2" / "wiki.test.raw"), role="eval")
    windows = eval_windows(tokenizer, text, 64, 2)
    ref = evaluate(model, windows)["ppl"]
    # an activation code at a rounding boundary can flip on fp32 noise and carry through the
    # layers, so the two agree to ~1e-3, within half the kernel's distance from the exact path
    err = abs(ref / report["kernel_ppl"] - 1)
    assert err < 2e-3 and err < abs(report["kernel_ppl_cost"]) / 2, (err, report["kernel_ppl_cost"])


@pytest.mark.slow
def test_with_the_head_as_stored_it_also_reports_the_decoders_default(
    tiny_dir, tmp_path, tokenizer
):
    out = tmp_path / "run"
    report = run_recipe("rtn_int4", tiny_dir, out, "decode.kernel=w4a8")
    assert report["kernel_layers"] == 2 * 7 and report["default_head"] == "int8"
    assert report["default_layers"] == 2 * 7 + 1  # the int8 head through the kernel too
    assert math.isclose(report["default_ppl_cost"], report["default_ppl"] / report["ppl"] - 1)
    assert len({report["ppl"], report["kernel_ppl"], report["default_ppl"]}) == 3
    assert report["default_kl_vs_source"] > 0
    # the default's figure is that of the folder loaded as the decoder loads it by default
    model = load_run(out)[0]
    quantize_head(
        model, "int8", json.loads((out / "config.json").read_text())["quantization_config"]
    )
    use(model, "w4a8", every_m=True)
    text = read_text(str(DATA / "wikitext-2" / "wiki.test.raw"), role="eval")
    windows = eval_windows(tokenizer, text, 64, 2)
    err = abs(evaluate(model, windows)["ppl"] / report["default_ppl"] - 1)
    assert err < 1e-6, err
