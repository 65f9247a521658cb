"""Model folders that are wrong in ways transformers does not check, and the decoder CLI's own
edges (issue 42, classes 4 and 6): each is one paragraph and exit status 2 (a CompressError
through the API) before anything decodes or evaluates, alike on the decoder CLI, the pipeline
and the server.

The folders are tiny random Llamas with a byte-level BPE (``compress.testing``), saved as HF
folders (no manifest: nothing hides the damage) and damaged the way a hand edit or a bad copy
damages them."""

import contextlib
import errno
import io
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_bad_input import ROOT, assert_clear, in_process, one_paragraph

import compress
from compress.errors import CompressError
from compress.io.tokenizer import check_ids, check_vocabulary, load_tokenizer
from compress.testing import random_model, run_folder, tiny_config, tiny_tokenizer

PROMPT = "the quick brown fox"


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    folder = tmp_path_factory.mktemp("hf") / "tiny"
    random_model(tiny_config()).save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    return folder


def damaged(hf: Path, tmp_path: Path, **config) -> Path:
    """A copy of ``hf`` with ``config`` written into its config.json (None deletes a field)."""
    folder = tmp_path / "bad"
    shutil.copytree(hf, folder)
    raw = json.loads((folder / "config.json").read_text())
    raw.update(config)
    raw = {k: v for k, v in raw.items() if v is not None}
    (folder / "config.json").write_text(json.dumps(raw))  # NaN and Infinity as Python writes them
    return folder


def decode(folder, *extra, prompt=PROMPT):
    """``python -m compress.decoder FOLDER --prompt ...``, in this process."""
    return in_process(
        "compress.decoder",
        str(folder),
        "--prompt",
        prompt,
        "--max-new-tokens",
        "2",
        "--no-warmup",
        "--device",
        "cpu",
        *extra,
    )


def no_run(folder, out: Path, *over):
    """The pipeline on ``folder``: a CompressError, and no run folder left behind."""
    with pytest.raises(CompressError) as e:
        compress.run(
            "rtn_int4", "eval.seqlen=64", "decode.enabled=false", *over, model=folder, out=out
        )
    assert not out.exists() and not list(out.parent.glob(f".{out.name}*"))
    return str(e.value)


def cli(*args, stdout=subprocess.PIPE, timeout=240):
    """``python -m compress.decoder ARGS`` in a subprocess; its output as bytes."""
    return subprocess.run(
        [sys.executable, "-m", "compress.decoder", *args],
        check=False,
        stdout=stdout,
        stderr=subprocess.PIPE,
        timeout=timeout,
        cwd=ROOT,
    )


# config.json: values transformers accepts but no model can run with

BAD_CONFIG = [
    ({"rms_norm_eps": -1.0}, "rms_norm_eps=-1.0"),
    ({"rms_norm_eps": 0.0}, "rms_norm_eps=0.0"),
    ({"rms_norm_eps": float("nan")}, "rms_norm_eps=nan"),
    ({"rms_norm_eps": float("inf")}, "rms_norm_eps=inf"),
    ({"num_hidden_layers": 0}, "num_hidden_layers=0"),
    ({"num_hidden_layers": -2}, "num_hidden_layers=-2"),
    ({"num_hidden_layers": "2"}, "num_hidden_layers='2'"),
    ({"num_attention_heads": 0}, "num_attention_heads=0"),
    ({"num_key_value_heads": 3}, "multiple of num_key_value_heads"),
    ({"num_key_value_heads": 0}, "num_key_value_heads=0"),
    ({"vocab_size": 0}, "vocab_size=0"),
    ({"intermediate_size": -1}, "intermediate_size=-1"),
    ({"max_position_embeddings": 0}, "max_position_embeddings=0"),
    ({"hidden_size": 66, "head_dim": None}, "multiple of num_attention_heads=4"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": -1.0}}, "rope_theta=-1.0"),
]


@pytest.mark.parametrize("config, needle", BAD_CONFIG, ids=[n for _, n in BAD_CONFIG])
def test_nonsense_config_values_are_refused_by_the_decoder(hf, tmp_path, config, needle):
    r = decode(damaged(hf, tmp_path, **config))
    assert_clear(r, needle, "config")


def test_the_intact_folder_decodes(hf):
    """The control of the cases here: the folder they damage decodes, exit 0."""
    r = decode(hf)
    assert r.returncode in (0, None), r.stderr[-2000:]
    assert "error" not in r.stderr and "TTFT" in r.stderr


@pytest.mark.parametrize(
    "config, needle",
    [
        ({"rms_norm_eps": -1.0}, "rms_norm_eps=-1.0"),
        ({"rms_norm_eps": float("nan")}, "rms_norm_eps=nan"),
        ({"num_hidden_layers": 0}, "num_hidden_layers=0"),
    ],
)
def test_nonsense_config_values_are_refused_by_the_pipeline_and_the_server(
    hf, tmp_path, config, needle
):
    """Before: ``ppl=nan`` with exit 0 and ``""`` served with HTTP 200 (eps), a traceback (no
    layers). Now the pipeline refuses before the model loads, the server before it listens."""
    bad = damaged(hf, tmp_path, **config)
    assert needle in no_run(bad, tmp_path / "out")
    assert_clear(in_process("compress.serve", str(bad), "--port", "0"), needle)


def test_a_verified_run_folder_edited_with_no_verify_is_still_checked(tmp_path):
    """``--no-verify`` skips the manifest's hashes, not the config's values."""
    run = run_folder(tmp_path / "run", random_model(tiny_config()), tiny_tokenizer())
    raw = json.loads((run / "config.json").read_text())
    (run / "config.json").write_text(json.dumps(dict(raw, rms_norm_eps=-1.0)))
    assert_clear(decode(run, "--no-verify"), "rms_norm_eps=-1.0")


# a tokenizer larger than the model's vocabulary


@pytest.fixture(scope="module")
def small_vocab(tmp_path_factory):
    """A model of 200 embeddings with the 300-token tokenizer of another."""
    folder = tmp_path_factory.mktemp("sv") / "small"
    random_model(tiny_config(vocab_size=200)).save_pretrained(folder)
    tiny_tokenizer(300).save_pretrained(folder)
    return folder


def test_a_tokenizer_larger_than_the_vocabulary_is_refused_by_the_decoder(small_vocab):
    r = decode(small_vocab)  # was: IndexError in the embedding
    assert_clear(r, "up to 299", "holds 200", "past the embedding")


def test_a_tokenizer_larger_than_the_vocabulary_is_refused_by_the_pipeline(
    small_vocab, tmp_path, monkeypatch
):
    """Refused after the tokenizer loads and before the weights do (was: IndexError in the
    evaluation, after the stages), disk-backed or not."""
    from transformers import AutoModelForCausalLM

    def no_weights(*a, **k):
        raise AssertionError("the weights loaded before the vocabulary was checked")

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", no_weights)
    monkeypatch.setattr("compress.io.checkpoint.open_lazy", no_weights)
    for offload in ("auto", "host"):
        msg = no_run(small_vocab, tmp_path / f"out-{offload}", f"offload={offload}")
        assert "holds 200" in msg and "past the embedding" in msg


@pytest.fixture(scope="module")
def placeholder(tmp_path_factory):
    """A tokenizer of 300 tokens plus an added ``<image>`` (id 300) that the 300-row model never
    embeds, as Gemma 3's text models ship one: only a text that spells it is refused."""
    folder = tmp_path_factory.mktemp("ph") / "ph"
    random_model(tiny_config()).save_pretrained(folder)
    tok = tiny_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": ["<image>"]})
    assert len(tok) == 301 and tok.convert_tokens_to_ids("<image>") == 300
    tok.save_pretrained(folder)
    return folder


def test_an_added_token_beyond_the_vocabulary_is_refused_only_when_spelled(placeholder):
    check_vocabulary(load_tokenizer(placeholder), 300, placeholder)  # ordinary text stays < 300
    r = decode(placeholder, prompt="hi <image>")
    assert_clear(r, "prompt token ids run from", "to 300", "vocabulary [0, 300)")
    ok = decode(placeholder)
    assert ok.returncode in (0, None) and "TTFT" in ok.stderr, ok.stderr[-2000:]


def test_the_server_and_the_decoder_refuse_prompt_ids_with_one_rule(placeholder):
    """The server's check of a prompt (``Engine.check``, HTTP 400) is the decoder CLI's."""
    from compress.decoder.model import load
    from compress.serve.engine import Engine
    from compress.serve.scheduler import Params

    model, tok = load(placeholder)
    ids = tok("hi <image>").input_ids
    with pytest.raises(CompressError) as served:
        Engine(model, tok, num_blocks=16, block_size=4).check(ids, Params(max_tokens=2))
    with pytest.raises(CompressError) as decoded:
        check_ids(ids, model.config.vocab_size)
    assert str(served.value) == str(decoded.value)
    with pytest.raises(CompressError, match=r"run from -1 to 5"):
        check_ids(torch.tensor([[5, -1]]), 300, "calibration")
    check_ids([], 300)  # an empty prompt is the callers' to refuse, with its own message
    check_ids(torch.tensor([[0, 299]]), 300)


# files of the folder: weights, tokenizer, chat template


def test_a_symlink_loop_as_the_weights_file(hf, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(hf, bad)
    (bad / "model.safetensors").unlink()
    os.symlink("model.safetensors", bad / "model.safetensors")
    r = decode(bad)  # was: FileNotFoundError from safetensors
    assert_clear(r, "model.safetensors", "too many levels of symbolic links")
    msg = no_run(bad, tmp_path / "out")  # was: OSError ELOOP after the config checks
    assert "too many levels of symbolic links" in msg


def test_a_dangling_symlink_as_the_weights_file(hf, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(hf, bad)
    (bad / "model.safetensors").unlink()
    os.symlink(tmp_path / "gone.safetensors", bad / "model.safetensors")
    assert_clear(decode(bad), "model.safetensors", "no such file")


def _tokenizer_damage(hf, tmp_path, how):
    bad = tmp_path / "bad"
    shutil.copytree(hf, bad)
    if how == "not JSON":
        (bad / "tokenizer.json").write_text('{"version": "1.0", "truncation": ')
    else:
        (bad / "tokenizer.json").unlink()
    return bad


@pytest.mark.parametrize(
    "how, needle",
    [("not JSON", "tokenizer.json' is not valid JSON"), ("missing", "has no tokenizer.json")],
)
def test_a_broken_tokenizer_is_refused_alike_by_the_decoder_and_the_pipeline(
    hf, tmp_path, how, needle
):
    bad = _tokenizer_damage(hf, tmp_path, how)
    r = decode(bad)  # was: JSONDecodeError or ValueError tracebacks
    assert_clear(r, needle, "tokenizer of model")
    assert r.stderr.strip().splitlines()[-1].removeprefix("error: ") == no_run(
        bad, tmp_path / "out"
    )  # the same check, the same paragraph


def _with_template(hf, tmp_path, template: str) -> Path:
    bad = tmp_path / "bad"
    shutil.copytree(hf, bad)
    cfg = json.loads((bad / "tokenizer_config.json").read_text())
    (bad / "tokenizer_config.json").write_text(json.dumps(dict(cfg, chat_template=template)))
    return bad


def test_a_chat_template_that_is_not_jinja(hf, tmp_path):
    bad = _with_template(hf, tmp_path, "{% if %}{{ messages[0]['content'] }}")
    r = decode(bad, "--chat")  # was: TemplateSyntaxError
    assert_clear(r, "not valid Jinja", "line 1", "Leave out --chat")
    plain = decode(bad)  # the template is read only for --chat
    assert plain.returncode in (0, None) and "TTFT" in plain.stderr, plain.stderr[-2000:]


def test_a_valid_chat_template_runs_with_chat(hf, tmp_path):
    """The control of the two template cases: the same path with a template that renders."""
    good = _with_template(hf, tmp_path, "{% for m in messages %}{{ m['content'] }} {% endfor %}")
    r = decode(good, "--chat")
    assert r.returncode in (0, None) and "TTFT" in r.stderr, r.stderr[-2000:]


def test_a_chat_template_that_refuses_the_messages(hf, tmp_path):
    template = (
        "{% if messages[0]['role'] != 'system' %}"
        "{{ raise_exception('the first message must be the system prompt') }}{% endif %}"
    )
    r = decode(_with_template(hf, tmp_path, template), "--chat")
    assert_clear(r, "refused the messages", "must be the system prompt")


# the decoder CLI's input and output


def test_a_prompt_that_is_not_utf8_on_argv(hf):
    """Bytes that are not UTF-8 reach Python as lone surrogates (surrogateescape)."""
    r = cli(str(hf), "--prompt", b"caf\xe9 au lait", "--device", "cpu")
    err = r.stderr.decode()
    assert r.returncode == 2 and one_paragraph(err), err[-2000:]
    assert "--prompt is not UTF-8" in err and "byte 0xe9 at character 3" in err
    assert r.stdout == b""


def test_a_stop_string_that_is_not_utf8(hf):
    r = in_process("compress.decoder", str(hf), "--prompt", "hi", "--stop", "\udcff")
    assert_clear(r, "--stop is not UTF-8", "byte 0xff")


def test_stdout_on_a_full_device(hf):
    with open("/dev/full", "wb") as full:
        r = cli(str(hf), "--prompt", PROMPT, "--max-new-tokens", "3", "--no-warmup", stdout=full)
    err = r.stderr.decode()
    assert r.returncode == 2, err[-2000:]
    assert "Traceback" not in err and "Exception ignored" not in err, err
    assert one_paragraph(err) and "No space left on device" in err
    assert err.strip().splitlines()[-1].startswith("error: cannot write the output")


def test_stdout_a_closed_pipe(hf):
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "compress.decoder",
            str(hf),
            "--prompt",
            PROMPT,
            "--max-new-tokens",
            "3",
            "--no-warmup",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=ROOT,
    )
    try:
        proc.stdout.close()  # the reader went away (``| head -c0``)
        assert proc.wait(timeout=240) == 2
        err = proc.stderr.read().decode()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
        proc.stderr.close()
    assert "Traceback" not in err and "Exception ignored" not in err, err
    assert one_paragraph(err) and "error: cannot write the output" in err


class FullStdout(io.StringIO):
    def write(self, text):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def test_json_output_on_a_full_device(hf):
    from compress.decoder.__main__ import main

    err = io.StringIO()
    with contextlib.redirect_stdout(FullStdout()), contextlib.redirect_stderr(err):
        with pytest.raises(SystemExit) as e:
            main([str(hf), "--prompt", "hi", "--max-new-tokens", "2", "--no-warmup", "--json"])
    assert e.value.code == 2 and one_paragraph(err.getvalue()), err.getvalue()
    assert "cannot write the output to standard output (No space left" in err.getvalue()
