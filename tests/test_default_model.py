"""Integration on the real default model (SmolLM2-135M), first 4 windows of 2048."""

import pytest
import torch

from compress.arch.adapters import get_adapter
from compress.eval.perplexity import evaluate
from compress.formats.quantizer import fake_quantize
from compress.io.data import eval_windows, read_text
from compress.io.source import load_model
from compress.recipe.pipeline import run
from tests.conftest import DATA, compose

pytestmark = pytest.mark.slow
FAST = ["eval.windows=4", "eval.compare_source=false", "decode.enabled=false"]


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    out = tmp_path_factory.mktemp("runs")
    return {r: run(compose(r, FAST), out / r) for r in ("fp", "rtn_int8", "rtn_int4", "rtn_int3")}


def test_perplexity_ordering(reports):
    fp, i8, i4, i3 = (reports[r]["ppl"] for r in ("fp", "rtn_int8", "rtn_int4", "rtn_int3"))
    assert 10 < fp < 40
    assert abs(i8 - fp) / fp < 0.01
    assert i8 < i4 < i3
    assert reports["rtn_int4"]["group_size"] == 64  # auto: 576 = 4.5 x 128


def test_saved_checkpoint_equals_fake_quant(reports):
    model, tok, _ = load_model()
    linears = get_adapter(model.config).all_linears(model).values()
    with torch.no_grad():  # the run folder holds the embedding and norms in float16
        for p in set(model.parameters()) - {lin.weight for lin in linears}:
            p.copy_(p.half().float())
    for lin in linears:
        lin.weight.data = fake_quantize(lin.weight.data, 4, 64)
    windows = eval_windows(tok, read_text(str(DATA / "wikitext-2" / "wiki.test.raw")), 2048, 4)
    fake = evaluate(model, windows)["ppl"]
    assert abs(reports["rtn_int4"]["ppl"] - fake) / fake < 1e-3
