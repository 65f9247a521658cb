"""Overrides checked before any work (issue 42, class 5), and the API edges of class 6.

Every bad override gets one paragraph naming the key and the fix, exit status 2, no traceback,
before the model loads (``compress.recipe.pipeline.load_source`` fails the test if it is reached); the
API refuses the same settings with a ``CompressError``. Each refusal has a passing twin, so a
check that refused everything would fail here too."""

import numpy as np
import pytest
import torch

import compress
from compress.decoder.sampling import Sampling, check_sampling
from compress.errors import CompressError
from compress.recipe.config import validate
from compress.recipe.overrides import compose as checked_compose
from compress.testing import random_model, tiny_config, tiny_tokenizer
from tests.conftest import compose
from tests.test_bad_input import assert_clear, in_process

# the tiny model (compress.testing) has max_position_embeddings=128
SMALL = [
    "eval.windows=1",
    "eval.seqlen=64",
    "calib.samples=2",
    "calib.seqlen=64",
    "decode.prefill_tokens=32",
    "distill.seqlen=32",
]


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    folder = tmp_path_factory.mktemp("hf")
    random_model(tiny_config()).save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    return folder


@pytest.fixture
def no_load(monkeypatch):
    """Reaching the model load fails the run (with a traceback, which ``assert_clear`` refuses)."""
    import compress.recipe.pipeline as pipeline

    def load(*a, **k):
        raise AssertionError("the model loaded before the override was checked")

    monkeypatch.setattr(pipeline, "load_source", load)


def small(recipe: str) -> list[str]:
    """``SMALL`` without the keys the recipe lacks (distill.* outside a distill recipe)."""
    return [o for o in SMALL if not o.startswith("distill.") or recipe.startswith("minitron")]


CLI_CASES = [
    # tracebacks before
    ("rtn_int4", ["eval.seqlen=1"], "eval.seqlen takes an integer >= 2"),
    ("rtn_int4", ["calib.seqlen=1"], "calib.seqlen takes an integer >= 2"),
    ("awq_int4", ["awq.n_grid=0"], "awq.n_grid takes an integer >= 1"),
    ("awq_int4", ["awq.n_grid=-3"], "awq.n_grid takes an integer >= 1"),
    ("awq_int4", ["awq.n_grid=1"], "awq.clip=false"),
    ("awq_int4", ["awq.batch=0"], "awq.batch takes an integer >= 1"),
    ("rtn_int4", ["~rtn.bits"], "set rtn.bits=VALUE instead"),
    ("rtn_int4", ["rtn=null"], "rtn is a group of keys"),
    ("rtn_int4", ["rtn.bits=null"], "has no null setting"),
    ("rtn_int4", ["~model"], "select another with model=NAME"),
    ("rtn_int4", ["stages=[rtn,rtn]"], "rtn is listed twice"),
    ("minitron_width", ["stages=[prune,distill,prune]"], "prune is listed twice"),
    (
        "rtn_int4",
        ["stages=[awq]"],
        "Use a recipe that runs it (awq_gptq_int3, awq_gptq_int4, awq_int3, awq_int4)",
    ),
    ("rtn_int4", ["seed=1180591620717411303424"], "seed is an integer from 0 to 2**64-1"),
    ("rtn_int4", ["seed=-1"], "seed is an integer from 0 to 2**64-1"),
    ("rtn_int4", ["seed=null"], "seed takes an integer"),
    ("minitron_width", ["seed=18446744073709551615"], "use a seed up to"),
    ("rtn_int4", ["eval.windows=${oc.env:COMPRESS_TEST_UNSET}"], "COMPRESS_TEST_UNSET"),
    ("rtn_int4", ["hydra.run.dir=${oc.env:COMPRESS_TEST_UNSET}/x"], "COMPRESS_TEST_UNSET"),
    # accepted silently before
    ("rtn_int4", ["eval.seqlen=200"], "beyond the model's max_position_embeddings=128"),
    ("awq_int4", ["calib.seqlen=129"], "calib.seqlen=129 is beyond"),
    ("minitron_width", ["distill.seqlen=256"], "distill.seqlen=256 is beyond"),
    ("awq_int4", ["awq.search_samples=0"], "awq.search_samples takes an integer >= 1 or null"),
    ("minitron_width", ["prune.round=0"], "prune.round takes an integer >= 1"),
    ("minitron_width", ["prune.calib.samples=0"], "prune.calib.samples takes an integer >= 1"),
    ("minitron_width", ["prune.depth_metric=ppl"], "needs prune.ppl_samples > 0"),
    ("minitron_width", ["prune.tolerance=1.5"], "a number from 0 to below 1"),
    ("minitron_width", ["distill.tokens=-1"], "distill.tokens takes an integer >= 0"),
    ("minitron_width", ["distill.grad_accum=0"], "distill.grad_accum takes an integer >= 1"),
    # found only after the whole run before
    ("rtn_int4", ["decode.new_tokens=0"], "decode.new_tokens takes an integer >= 2"),
    ("rtn_int4", ["decode.new_tokens=1"], "decode.enabled=false"),
    ("rtn_int4", ["decode.kv=kivi", "decode.compile=true"], "decode.compile=false"),
    (
        "rtn_int4",
        ["eval.seqlen=128", "decode.prefill_tokens=512"],
        "Set decode.prefill_tokens=127 or less",
    ),
]


@pytest.mark.parametrize(
    "recipe, overrides, needle", CLI_CASES, ids=[" ".join(c[1]) for c in CLI_CASES]
)
def test_bad_override_is_one_paragraph_before_the_model_loads(
    hf, tmp_path, no_load, monkeypatch, recipe, overrides, needle
):
    monkeypatch.delenv("COMPRESS_TEST_UNSET", raising=False)
    out = tmp_path / "run"
    r = in_process(
        "compress",
        f"recipe={recipe}",
        f"model.path={hf}",
        *small(recipe),
        *overrides,
        f"hydra.run.dir={out}",
    )
    assert_clear(r, needle)
    assert not out.exists() and not list(tmp_path.iterdir())


GOOD = [  # the twins of the refusals above: each passes validation
    ("rtn_int4", ["eval.seqlen=2", "eval.windows=null", "seed=18446744073709551615"]),
    ("awq_int4", ["awq.n_grid=1", "awq.clip=false", "awq.search_samples=null", "awq.batch=1"]),
    ("rtn_int4", ["eval.seqlen=128", "calib.seqlen=128", "decode.prefill_tokens=127"]),
    ("rtn_int4", ["decode.kv=kivi", "decode.new_tokens=2", "decode.threads=null"]),
    ("rtn_int4", ["decode.kv=full", "decode.compile=true"]),
    ("rtn_int4", ["data.eval.source=${oc.env:COMPRESS_DATA_DIR}/wikitext-2/wiki.test.raw"]),
    ("rtn_int4", ["model.dtype=${oc.env:COMPRESS_TEST_UNSET,float32}"]),
    ("minitron_width", ["prune.round=1", "prune.tolerance=0", "distill.tokens=0", "seed=7"]),
    ("minitron_width", ["prune.target_params=null", "prune.export.num_hidden_layers=1"]),
    ("minitron_width", ["prune.depth_metric=ppl", "prune.ppl_samples=2"]),
]


@pytest.mark.parametrize("recipe, overrides", GOOD, ids=[" ".join(c[1]) for c in GOOD])
def test_good_overrides_pass_validation(hf, monkeypatch, recipe, overrides):
    monkeypatch.delenv("COMPRESS_TEST_UNSET", raising=False)
    cfg = checked_compose(recipe, [f"model.path={hf}", *small(recipe), *overrides])
    validate(cfg)


def test_prune_round_and_tolerance_reach_the_solver_as_given(monkeypatch):
    """prune.tolerance=0 was replaced by 0.03 (``x or default``); now only null is."""
    import compress.methods.prune.stage as stage

    seen = []
    monkeypatch.setattr(stage, "solve_budget", lambda *a: seen.append(a[-2:]) or {})
    monkeypatch.setattr(stage, "check_sizes", lambda *a: None)
    model = random_model(tiny_config())
    for over, expect in ((["prune.tolerance=0", "prune.round=16"], (16, 0.0)), ([], (8, 0.03))):
        stage.target_sizes(model, compose("minitron_width", over).prune)
        assert seen.pop() == expect


# ---- the Python API -------------------------------------------------------------------------

RTN = compress.RTNConfig(bits=4, group_size=32)


def test_quantizing_twice_is_refused_naming_the_quantized_layer():
    model = compress.quantize(random_model(tiny_config()), RTN)
    with pytest.raises(CompressError, match="already quantized.*q_proj is QuantLinear"):
        compress.quantize(model, RTN)
    model.config.quantization_config = None  # the layers alone tell
    with pytest.raises(CompressError, match="already quantized.*QuantLinear"):
        compress.quantize(model, compress.Int8Config())


def test_a_loaded_quantized_run_folder_is_refused(tmp_path):
    from compress.io.checkpoint import load_run

    folder = compress.save(compress.quantize(random_model(tiny_config()), RTN), tmp_path / "q")
    model = load_run(folder)[0]
    with pytest.raises(CompressError, match="already quantized"):
        compress.quantize(model, RTN)


def test_a_compiled_model_saves_its_own_names(tmp_path):
    """``quantize(torch.compile(model))`` quantizes the module inside the wrapper, and ``save``
    writes its names (no ``_orig_mod.``), which the decoder loads."""
    from safetensors import safe_open

    from compress.decoder.generate import generate
    from compress.decoder.model import load

    compiled = torch.compile(random_model(tiny_config()))
    assert compress.quantize(compiled, RTN) is compiled
    folder = compress.save(compiled, tmp_path / "c")
    names = [n for f in folder.glob("*.safetensors") for n in safe_open(f, "pt").keys()]
    assert names and not [n for n in names if n.startswith("_orig_mod")]
    assert "model.layers.0.self_attn.q_proj.weight_packed" in names
    model, _ = load(folder)
    assert len(generate(model, [[1, 2, 3]], 2, ignore_eos=True).tokens[0]) == 2


@pytest.mark.parametrize("what", ["quantize", "save"])
def test_a_model_on_the_meta_device_is_refused(tmp_path, what):
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(tiny_config())
    with pytest.raises(CompressError, match=f"{what}: .*meta device.*from_pretrained"):
        if what == "quantize":
            compress.quantize(model, RTN)
        else:
            compress.save(model, tmp_path / "m")
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize(
    "kw, needle",
    [
        (dict(options="n_grid=2"), "options is a dict of awq.* keys"),
        (dict(options=["n_grid", 2]), "options is a dict"),
        (dict(calib_samples=-1), "AWQConfig\\(calib_samples=-1\\)"),
        (dict(calib_samples=0), "calib_samples is an integer >= 1"),
        (dict(calib_seqlen=1), "calib_seqlen is an integer >= 2"),
    ],
)
def test_awq_config_refuses_what_it_cannot_pass_on(kw, needle):
    with pytest.raises(CompressError, match=needle):
        compress.AWQConfig(**kw)


def test_awq_options_are_checked_before_calibration(monkeypatch):
    import compress.methods.quant.awq as awq

    monkeypatch.setattr(awq, "capture_inputs", lambda *a, **k: pytest.fail("calibrated"))
    model = random_model(tiny_config())
    ids = torch.randint(0, 300, (2, 16))
    for options, needle in (({"n_grid": 0}, "awq.n_grid"), ({"batch": 0}, "awq.batch")):
        with pytest.raises(CompressError, match=needle):
            compress.quantize(model, compress.AWQConfig(group_size=32, options=options), None, ids)
    assert type(model.model.layers[0].mlp.down_proj) is torch.nn.Linear  # untouched


def test_run_api_refuses_a_bad_override_before_loading(hf, tmp_path, no_load):
    with pytest.raises(CompressError, match="eval.seqlen takes an integer >= 2"):
        compress.run("rtn_int4", *SMALL[:-1], "eval.seqlen=1", model=hf, out=tmp_path / "r")
    with pytest.raises(CompressError, match="rtn.bits=null"):
        compress.run("rtn_int4", *SMALL[:-1], model=hf, out=tmp_path / "r", rtn={"bits": None})
    assert not (tmp_path / "r").exists()


def test_numpy_scalars_are_sampling_settings():
    s = Sampling(np.float32(0.5), np.int64(5), np.float64(0.9), np.uint64(3))
    assert (s.temperature, s.top_k, s.top_p, s.seed) == (0.5, 5, pytest.approx(0.9), 3)
    assert all(type(v) in (int, float) for v in (s.temperature, s.top_k, s.top_p, s.seed))
    assert s == Sampling(0.5, 5, 0.9, 3)
    with pytest.raises(CompressError, match="temperature=.*from 0"):
        check_sampling(np.float32(3.0))  # still refused out of range
    with pytest.raises(CompressError, match="top-k"):
        Sampling(top_k=np.float32(5))  # not an integer
    with pytest.raises(CompressError, match="temperature"):
        Sampling(np.bool_(True))


def test_interpolations_that_resolve_pass_the_override_check(monkeypatch):
    from compress.recipe.overrides import check_overrides

    monkeypatch.setenv("COMPRESS_TEST_SET", "out")
    check_overrides(
        "fp",
        [
            "hydra.run.dir=${oc.env:COMPRESS_TEST_SET}/${now:%Y}_${name}",
            "eval.device=${oc.env:COMPRESS_TEST_UNSET,cpu}",
        ],
    )
    with pytest.raises(CompressError, match="eval.device=\\$\\{name_typo\\}"):
        check_overrides("fp", ["eval.device=${name_typo}"])
