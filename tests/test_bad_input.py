"""Bad input on every surface gets one paragraph naming the problem and the fix, exit status 2 on
the CLIs, no traceback, and no run folder left behind, before any expensive work.

One test per class of issue 25 (checks after the work, raw tracebacks, the decoder CLI's
sampling settings, leftovers); the other hostile inputs are in ``tests/test_hostile_inputs.py``."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import compress
from compress.decoder.sampling import Sampling, check_sampling
from compress.errors import CompressError
from compress.testing import random_model, run_folder, tiny_config, tiny_tokenizer

ROOT = Path(__file__).resolve().parent.parent


def one_paragraph(text: str) -> bool:
    lines = [ln for ln in text.strip().splitlines() if ln.strip() and "%|" not in ln]
    return 0 < len(lines) <= 2 and "\n\n" not in text.strip() and "Traceback" not in text


def cli(*args, timeout=300):
    return subprocess.run(
        [sys.executable, "-m", *args],
        check=False,
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
    )


class Result:
    def __init__(self, returncode, stdout, stderr):
        self.returncode, self.stdout, self.stderr = returncode, stdout, stderr


def in_process(module: str, *args) -> Result:
    """``python -m MODULE ARGS`` run in this process (its ``main``), output captured."""
    import contextlib
    import importlib
    import io

    main = importlib.import_module(f"{module}.__main__").main
    out, err, old = io.StringIO(), io.StringIO(), sys.argv
    code = 0
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            if module == "compress":
                sys.argv = ["compress", *args]
                main()
            else:
                main(list(args))
        except SystemExit as e:
            code = e.code
        finally:
            sys.argv = old
    return Result(code, out.getvalue(), err.getvalue())


def assert_clear(r, *needles):
    assert r.returncode == 2, (r.returncode, r.stdout[-500:], r.stderr[-2000:])
    text = (r.stdout + r.stderr).strip()
    assert "Traceback" not in text, text
    assert one_paragraph(text), text
    for n in needles:
        assert n in text, text


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    folder = tmp_path_factory.mktemp("hf")
    random_model(tiny_config()).save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("run")
    return run_folder(
        root / "run", random_model(tiny_config()), tiny_tokenizer(), rtn={"group_size": 16}
    )


# class 2: inputs checked before the model loads


def test_an_empty_eval_text_fails_before_the_model_loads(hf, tmp_path, monkeypatch):
    from compress.recipe import pipeline

    def no_load(*a, **k):
        raise AssertionError("the model loaded before the eval text was checked")

    empty = tmp_path / "empty.txt"
    empty.write_text("")
    out = tmp_path / "out"
    r = cli(
        "compress",
        "recipe=rtn_int4",
        f"model.path={hf}",
        f"data.eval.source={empty}",
        "eval.seqlen=64",  # within the tiny model's 128 positions
        f"hydra.run.dir={out}",
    )
    assert_clear(r, "empty", "data.eval.source")
    assert not out.exists()
    monkeypatch.setattr(pipeline, "load_model", no_load)
    short = tmp_path / "short.txt"
    short.write_text("a few words of text. " * 4)
    for over, needle in (
        (
            [f"data.eval.source={short}", "eval.seqlen=64", "eval.windows=8", "calib.seqlen=64"],
            "eval.windows=8",
        ),
        (
            [f"data.calib.source={short}", "calib.samples=16", "calib.seqlen=64", "eval.seqlen=64"],
            "calib.samples=16",
        ),
    ):
        with pytest.raises(CompressError, match=needle):
            compress.run("awq_int4", *over, model=hf, out=out)
        assert not out.exists()


def test_count_tokens_in_chunks_matches_the_whole_text(tokenizer):
    from compress.recipe.inputs import count_tokens

    text = (ROOT.parent / "shared" / "data" / "wikitext-2" / "wiki.valid.tokens").read_text()[
        :600_000
    ]
    whole = len(tokenizer(text, add_special_tokens=True).input_ids)
    assert abs(count_tokens(tokenizer, text, 10**9) - whole) <= 8  # chunks cut at line ends
    assert count_tokens(tokenizer, text, 1000) < whole  # stops once enough are counted


# class 3: raw tracebacks


def test_unknown_model_type_and_unwritable_run_dirs(hf, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(hf, bad)
    c = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps(dict(c, model_type="lama")))
    out = tmp_path / "out"
    r = cli("compress", "recipe=rtn_int4", f"model.path={bad}", f"hydra.run.dir={out}")
    assert_clear(r, "model_type 'lama'", "llama")
    assert not out.exists()
    r = in_process("compress.decoder", str(bad), "--prompt", "hi")
    assert_clear(r, "model_type 'lama'")
    afile = tmp_path / "a_file"
    afile.write_text("x")
    for d, needle in (("/proc/x", "cannot be written"), (f"{afile}/sub", "which is a file")):
        r = in_process("compress", "recipe=rtn_int4", f"model.path={hf}", f"hydra.run.dir={d}")
        assert_clear(r, needle, "hydra.run.dir")


def test_the_writability_probe_never_enters_the_run_folder(tmp_path, monkeypatch):
    """Each rank of ``accelerate launch`` checks the run folder that the other's Hydra may have
    made already: the probe goes beside it, so the folder never holds a file another rank's
    emptiness check could see."""
    from compress.io import run_folder

    run = tmp_path / "runs" / "two"
    run.mkdir(parents=True)  # the other rank's Hydra placeholder
    seen = []
    real = run_folder.tempfile.mkdtemp

    def probe(**kw):
        made = real(**kw)
        seen.append((Path(kw["dir"]), any(run.iterdir())))
        return made

    monkeypatch.setattr(run_folder.tempfile, "mkdtemp", probe)
    run_folder.check_writable(run, "run folder")
    run_folder.check_writable(tmp_path / "new" / "deeper", "run folder")
    assert seen == [(run.parent, False), (tmp_path, False)]
    assert not any(run.iterdir()) and not any(run.parent.glob(".compress-probe-*"))


def test_devices_and_ports_are_checked_before_loading(run):
    gpu = torch.cuda.is_available()
    devices = (["cuda:99"] if gpu else ["cuda"]) + ["tpu9"]
    r = cli("compress.decoder", str(run), "--prompt", "hi", "--device", devices[0])
    assert_clear(r, f"--device {devices[0]}", "cpu")
    for device in devices[1:]:
        r = in_process("compress.decoder", str(run), "--prompt", "hi", "--device", device)
        assert_clear(r, f"--device {device}", "cpu")
    r = in_process("compress.serve", str(run), "--device", "tpu9")
    assert_clear(r, "--device tpu9")
    r = cli("compress.serve", str(run), "--port", "99999")
    assert_clear(r, "--port 99999", "65535")


def test_api_refuses_what_is_not_a_model_and_paths_it_cannot_write(tmp_path):
    rtn = compress.RTNConfig(bits=4, group_size=64)
    for call in (
        lambda: compress.quantize(torch.nn.Linear(64, 64), rtn),
        lambda: compress.save(torch.nn.Linear(64, 64), tmp_path / "lin"),
    ):
        with pytest.raises(CompressError, match="Hugging Face causal LM.*not Linear"):
            call()
    assert not (tmp_path / "lin").exists()
    afile = tmp_path / "f"
    afile.write_text("x")
    model = random_model(tiny_config())
    for folder, needle in (
        (afile, "is a file"),
        (afile / "sub", "which is a file"),
        ("/proc/x", "cannot be written"),
    ):
        with pytest.raises(CompressError, match=needle):
            compress.save(model, folder)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f"]  # no temporary folder left


# class 4: one validation of the sampling settings


BAD_SAMPLING = [
    ("temperature", -1.0, "--temperature"),
    ("temperature", float("nan"), "--temperature"),
    ("top_p", 2.0, "--top-p"),
    ("top_p", 0.0, "--top-p"),
    ("top_k", 0, "--top-k"),
    ("seed", 2**70, "--seed"),
    ("seed", -1, "--seed"),
    ("max_new_tokens", 0, "--max-new-tokens"),
    ("max_new_tokens", -1, "--max-new-tokens"),
    ("threads", 0, "--threads"),
]


@pytest.mark.parametrize("field, value, flag", BAD_SAMPLING)
def test_sampling_settings_are_refused_alike_by_cli_api_and_server(run, capsys, field, value, flag):
    from compress.decoder.__main__ import main
    from compress.serve.protocol import CompletionRequest

    argv = [str(run), "--prompt", "hi", "--device", "cpu", "--temperature", "0.7"]
    with pytest.raises(SystemExit) as e:
        main(argv + [flag, str(value)])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert one_paragraph(err) and err.startswith(f"error: {flag} ")
    with pytest.raises(CompressError) as api:
        check_sampling(**{field: value})
    rule = str(api.value).split(": ", 1)[1]
    assert rule in err  # the same rule, spelled with the flag
    if field in ("temperature", "top_p", "top_k", "seed"):
        with pytest.raises(CompressError, match=field):
            Sampling(**{"temperature": 0.7, field: value})
    if field != "threads":
        key = "max_tokens" if field == "max_new_tokens" else field
        body = CompletionRequest(model="m", prompt="hi", **{key: value})
        with pytest.raises(CompressError) as srv:
            body.params(16)
        assert srv.value.param == key and rule in str(srv.value)


def test_good_sampling_settings_pass():
    check_sampling(0.0, None, None, None)
    check_sampling(2.0, 1, 1.0, 2**64 - 1, 1, 1, ["a", "b"])
    Sampling(0.7, 50, 0.95, 0)


# class 6: leftovers


def test_config_errors_leave_no_run_folder(hf, tmp_path):
    out = tmp_path / "out"
    for over in ("rtn.bits=9", "eval.device=tpu", f"data.eval.source={tmp_path}/none.txt"):
        r = in_process(
            "compress", "recipe=rtn_int4", f"model.path={hf}", over, f"hydra.run.dir={out}"
        )
        assert_clear(r)
        assert not out.exists(), over
