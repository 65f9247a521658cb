"""``compress.decoder.runtime``: one ``RuntimeConfig``, resolved by ``resolve_runtime`` for the
decoder CLI, a ``--draft`` folder, the server, ``compress.load`` and ``report.json``'s
``decoder_default``. The expected configurations are written out here from the documented rule
(docs/decoder.md, "Default configuration"), not read from the module's constants; a refused
conflict is checked against the loader refusing the same settings after reading the weights."""

import dataclasses
import json

import pytest
import torch

import compress
from compress.decoder.__main__ import configuration, main
from compress.decoder.__main__ import parse_args as decoder_args
from compress.decoder.model import load
from compress.decoder.runtime import RuntimeConfig, resolve_runtime
from compress.decoder.speculative.cli import draft_runtime
from compress.errors import CompressError
from compress.kernels import w4a8_cpu
from compress.layers import QuantLinear
from compress.recipe.pipeline import decoder_default
from compress.serve.__main__ import load_model as serve_load
from compress.serve.__main__ import parse_args as serve_args
from compress.serve.__main__ import resolve_configuration
from compress.serve.engine import invariant_model
from compress.testing import random_model, run_folder, tiny_config, tiny_tokenizer

C_KERNELS = any(p in w4a8_cpu.available() for p in ("vnni", "avx2", "portable"))

# the fast configuration of a group-quantized folder on the CPU (vocabulary a multiple of 32)
FAST = RuntimeConfig(device="cpu", dtype="bfloat16", qdtype="bfloat16", kernel="w4a8",
                     head="int8", lean=True, compile=True, fast=True)  # fmt: skip
# the server's: batch-invariant in place of the compiled step
SERVING = dataclasses.replace(FAST, compile=False, batch_invariant=True)
FAITHFUL = RuntimeConfig(device="cpu", dtype="float32", qdtype="float32")
# the bug of issue 39: naming these dropped the W4A8 kernel and the int8 head (76 vs 135 tok/s)
BUG_FLAGS = ["--dtype", "bfloat16", "--lean", "--compile"]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """``(q4, fp, odd)``: a tiny int4 run folder (RTN, groups of 32), its float twin, and an
    int4 folder whose vocabulary (300) is not a multiple of 32."""
    root = tmp_path_factory.mktemp("runtime")
    tok = tiny_tokenizer()
    rtn = dict(bits=4, group_size=32)
    q4 = run_folder(root / "q4", random_model(tiny_config(vocab_size=320)), tok, rtn)
    fp = run_folder(root / "fp", random_model(tiny_config(vocab_size=320)), tok)
    odd = run_folder(root / "odd", random_model(tiny_config()), tok, rtn)
    return q4, fp, odd


def decoder(folder, *flags) -> RuntimeConfig:
    """The decoder CLI's configuration for ``flags``."""
    return configuration(decoder_args([str(folder), "--prompt", "x", "--device", "cpu", *flags]))


def server(folder, *flags) -> RuntimeConfig:
    return resolve_configuration(serve_args([str(folder), *flags]), "cpu")


def draft(target, folder, *flags) -> RuntimeConfig:
    """The ``--draft folder`` configuration, as the decoder CLI's ``run`` settles it."""
    args = decoder_args(
        [str(target), "--prompt", "x", "--device", "cpu", "--draft", str(folder), *flags]
    )
    conf = configuration(args)
    args.compile_flag, args.compile = args.compile, conf.compile
    return draft_runtime(args, conf)


def test_naming_the_dtype_keeps_the_fast_kernel_and_head(folders):
    """``--dtype bfloat16 --lean --compile`` on an int4 folder: the W4A8 kernel and the int8
    head stay, and the model loads with them (each int layer on W4A8, the head quantized)."""
    q4, fp, _ = folders
    assert decoder(q4) == FAST
    assert decoder(q4, *BUG_FLAGS) == FAST
    assert draft(fp, q4, *BUG_FLAGS) == FAST
    assert decoder(q4, "--dtype", "bfloat16") == FAST
    model, _ = load(q4, runtime=decoder(q4, *BUG_FLAGS))
    layers = [m for m in model.modules() if isinstance(m, QuantLinear)]
    assert model.lm_head in layers and model.lm_head.bits == 8
    assert len(layers) == 2 * 4 + 1 and all(m.kernel == "w4a8" for m in layers)
    assert model.model.embed_tokens.weight.dtype == torch.bfloat16


# one named setting (as flags, and as compress.load's keywords) -> the fields it changes from
# the fast configuration
DECODER_CASES = [
    (["--kernel", "exact"], dict(kernel="exact"), dict(kernel="exact")),
    (["--head", "none"], dict(head="none"), dict(head="none")),
    (["--head", "int4"], dict(head="int4"), dict(head="int4")),
    (["--no-lean"], dict(lean=False), dict(lean=False)),
    (["--no-compile"], dict(compile=False), dict(compile=False)),
    (["--threads", "2"], dict(threads=2), dict(threads=2)),
    # the compatible choice for the settings not named: lean keeps only a bfloat16 form
    (["--qdtype", "float32"], dict(qdtype="float32"), dict(qdtype="float32", lean=False)),
    # qdtype follows dtype unless named
    (["--dtype", "float16"], dict(dtype=torch.float16),
     dict(dtype="float16", qdtype="float16", lean=False)),
    (["--dtype", "float16", "--qdtype", "bfloat16"], dict(dtype="float16", qdtype="bfloat16"),
     dict(dtype="float16")),
]  # fmt: skip


@pytest.mark.parametrize("flags,api,changed", DECODER_CASES)
def test_a_named_setting_replaces_only_itself(folders, flags, api, changed):
    q4, fp, _ = folders
    want = dataclasses.replace(FAST, **changed)
    assert decoder(q4, *flags) == want
    assert draft(fp, q4, *flags) == want  # the draft folder in the same named settings
    model, _, runtime = compress.load(q4, **api)  # the Python API, a dtype as torch's too
    assert runtime == want
    assert model.model.embed_tokens.weight.dtype == getattr(torch, want.dtype)


SERVER_CASES = [
    ([], {}),
    (["--no-batch-invariant"], dict(batch_invariant=False, lean=False)),
    (["--threads", "2"], dict(threads=2)),
    (["--head", "int4"], dict(head="int4")),
    # settings that rule invariance out turn it (and its lean default) off
    (["--kernel", "exact"], dict(kernel="exact", batch_invariant=False, lean=False)),
    (["--head", "none"], dict(head="none", batch_invariant=False, lean=False)),
    (["--qdtype", "float32"], dict(qdtype="float32", batch_invariant=False, lean=False)),
    (["--prefill-ranks", "2"], dict(batch_invariant=False, lean=False)),
    (
        ["--dtype", "float32"],
        {**dataclasses.asdict(FAITHFUL), "fast": False, "lean": False, "batch_invariant": False},
    ),  # fmt: skip
]


@pytest.mark.parametrize("flags,changed", SERVER_CASES)
def test_the_server_resolves_the_same_rule(folders, flags, changed):
    q4, _, _ = folders
    assert server(q4, *flags) == dataclasses.replace(SERVING, **changed)


def test_other_folders_run_the_exact_path(folders):
    q4, fp, odd = folders
    assert decoder(fp) == FAITHFUL and server(fp) == FAITHFUL
    assert decoder(q4, "--dtype", "float32") == FAITHFUL
    assert decoder(fp, "--dtype", "bfloat16") == dataclasses.replace(
        FAITHFUL, dtype="bfloat16", qdtype="bfloat16"
    )
    # the fast head needs a vocabulary of whole words of 32 rows
    assert decoder(odd) == dataclasses.replace(FAST, head="none")
    assert server(odd) == dataclasses.replace(
        SERVING, head="none", batch_invariant=False, lean=False
    )
    # the folder's recorded head is the default for every path
    manifest = json.loads((q4 / "manifest.json").read_text())
    manifest["recipe"]["quant"] = {"lm_head": "int4"}
    (q4 / "manifest.json").write_text(json.dumps(manifest))
    try:
        assert decoder(q4).head == "int4" and decoder(q4, "--dtype", "float32").head == "int4"
        assert server(q4).head == "int4" and decoder(q4, "--head", "none").head == "none"
    finally:
        del manifest["recipe"]["quant"]
        (q4 / "manifest.json").write_text(json.dumps(manifest))


def test_conflicts_are_refused_before_loading(folders, capsys):
    """Named settings that cannot hold together are one CompressError naming them and the fix;
    the loader refuses the same settings (after reading the weights)."""
    q4, fp, odd = folders
    with pytest.raises(CompressError, match=r"lean=true .*qdtype=float32 \(the default\).*"
                       r"kernel=exact .*--dtype bfloat16.*or leave out --lean"):  # fmt: skip
        decoder(q4, "--dtype", "float32", "--lean")
    with pytest.raises(CompressError, match="lean loading keeps only"):
        load(q4, dtype=torch.float32, lean=True)  # the loader's own refusal
    with pytest.raises(CompressError, match=r"qdtype=float16 \(named\)"):
        decoder(q4, "--qdtype", "float16", "--kernel", "exact", "--lean")
    assert not decoder(fp, "--lean").fast  # lean on a float folder keeps nothing different
    with pytest.raises(CompressError, match="300 rows, not a multiple of 32"):
        decoder(odd, "--head", "int8")
    with pytest.raises(CompressError, match="not a multiple of 32"):
        load(odd, head="int8")
    with pytest.raises(CompressError, match="kernel exact was named: leave out one"):
        server(q4, "--batch-invariant", "--kernel", "exact")
    with pytest.raises(CompressError, match="head=none .named.: name --head int8"):
        server(q4, "--batch-invariant", "--head", "none")
    with pytest.raises(CompressError, match="group-quantized folder .* on the CPU"):
        server(fp, "--batch-invariant")
    # named invariance takes the fast head where the folder's vocabulary allows one
    assert server(q4, "--batch-invariant", "--dtype", "float32").head == "int8"
    with pytest.raises(CompressError, match="unknown runtime setting"):
        resolve_runtime(q4, "cpu", {"kernels": "w4a8"})
    with pytest.raises(CompressError, match="dtype='fp8': use one of"):
        compress.load(q4, dtype="fp8")
    with pytest.raises(CompressError, match="threads=0"):
        resolve_runtime(q4, "cpu", {"threads": 0})
    with pytest.raises(SystemExit):  # the CLI: one line, before anything loads
        main([str(q4), "--prompt", "x", "--device", "cpu", "--dtype", "float32", "--lean"])
    err = capsys.readouterr().err
    assert err.startswith("error: lean=true") and len(err.splitlines()) == 1


def test_cuda_only_conflicts(folders, monkeypatch):
    """The compiled step and lean forms are the CPU's: named on CUDA, they are refused (a
    machine with a GPU is stood in for: nothing is loaded)."""
    q4, _, _ = folders
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    conf = resolve_runtime(q4, "cuda", {})
    assert conf == dataclasses.replace(FAITHFUL, device="cuda")  # no fast CPU choice on CUDA
    with pytest.raises(CompressError, match="compile=true .* for the CPU"):
        resolve_runtime(q4, "cuda", {"compile": True})
    with pytest.raises(CompressError, match="lean=true .* device is cuda"):
        resolve_runtime(q4, "cuda", {"lean": True, "dtype": "bfloat16"})


@pytest.mark.parametrize("flags", [[], BUG_FLAGS, ["--dtype", "bfloat16", "--kernel", "exact"],
                                   ["--dtype", "float32"], ["--head", "int4", "--no-lean"]])  # fmt: skip
def test_every_entry_point_resolves_one_runtime(folders, flags):
    """The decoder CLI, a ``--draft`` folder, ``compress.load`` and the pipeline's
    ``decoder_default`` get the same ``RuntimeConfig`` for the same folder, device and named
    settings; the server the same but for serving's trade (invariance, not the compiled step)."""
    q4, fp, _ = folders
    conf = decoder(q4, *flags)
    assert draft(fp, q4, *flags) == conf
    named = {k: v for k, v in vars(decoder_args([str(q4), "--prompt", "x", *flags])).items()
             if k in ("dtype", "kernel", "head", "lean", "compile") and v is not None}  # fmt: skip
    assert compress.load(q4, **named)[2] == conf
    serving = server(q4, *(f for f in flags if f not in ("--lean", "--no-lean", "--compile")))
    keep = ("device", "dtype", "qdtype", "head", "threads", "fast")
    assert {k: getattr(serving, k) for k in keep} == {k: getattr(conf, k) for k in keep}
    assert not serving.compile
    assert serving.batch_invariant == (conf.fast and conf.kernel == "w4a8" and conf.head != "none")
    if not flags:
        assert decoder_default(q4, "none") == {"decoder_default": conf.as_dict()}
        assert decoder_default(q4, "int4") == {
            "decoder_default": decoder(q4, "--head", "int4").as_dict()
        }
        assert decoder_default(fp, "none") == {}


@pytest.mark.skipif(not C_KERNELS, reason="the C++ kernels did not build")
def test_the_server_loads_in_its_configuration(folders):
    """``python -m compress.serve Q4``'s model: every linear through W4A8 at every batch size,
    the head quantized (what batch invariance needs)."""
    q4, _, _ = folders
    args = serve_args([str(q4)])
    model, tok = serve_load(args, "cpu")
    assert args.batch_invariant and invariant_model(model) and tok is not None
    assert isinstance(model.lm_head, QuantLinear) and model.lm_head.bits == 8


def test_the_decoder_prints_and_reports_its_runtime(folders, capsys):
    """The configuration that runs: one line on stderr first, ``runtime`` in ``--json`` (and
    ``draft_runtime`` with ``--draft``)."""
    q4, fp, _ = folders
    base = ["--prompt", "the quick", "--max-new-tokens", "3", "--device", "cpu", "--no-warmup"]
    flags = ["--dtype", "bfloat16", "--lean", "--no-compile"]
    main([str(q4), *base, *flags, "--json"])
    out = json.loads(capsys.readouterr().out)
    assert out["runtime"] == dataclasses.replace(FAST, compile=False).as_dict()
    main([str(q4), *base, *flags])
    err = capsys.readouterr().err.splitlines()
    assert err[0] == dataclasses.replace(FAST, compile=False).describe()
    assert "kernel w4a8" in err[0] and "head int8" in err[0]
    main([str(fp), *base, "--no-compile", "--json", "--draft", str(q4)])
    out = json.loads(capsys.readouterr().out)
    assert out["runtime"] == FAITHFUL.as_dict()
    assert out["draft_runtime"] == dataclasses.replace(FAST, compile=False).as_dict()
