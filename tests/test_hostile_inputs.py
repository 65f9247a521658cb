"""Hostile inputs on the four surfaces get a clear error: the pipeline CLI (``python -m
compress``), the decoder CLI (``python -m compress.decoder``), the server (its CLI, and HTTP
requests to it) and the Python API (``compress.run/quantize/save``, ``Sampling``).

Clear means: a CLI exits with status 2, prints one paragraph and no traceback, and leaves no run
folder behind; an HTTP request gets its status with an OpenAI error body (``{"error":
{"message", "type"}}``) and the server still answers ``/health``; an API call raises a
one-paragraph ``CompressError``. Each message names what it refused (the flag, key, field or
file given). One test per input, in this process (the CLIs' ``main`` with the arguments a shell
would pass), against tiny random folders built once for the module.

These were the cases of the sweep script ``eval/bench/hostile_sweep.py`` (removed); the ones
other tests already ran the same way are tested there, not here (the map below)."""

# Where each case of the sweep is tested. Cases not listed run here, one test each, under the
# sweep's name: the rows of PIPELINE, DECODER_FOLDERS, DECODER_FLAGS, SERVE_CLI, HTTP and API
# below (ids ``test_pipeline_cli[<name>]``, ``test_decoder_cli_folder[<name>]``, ...), and
# test_decoder_cli_generates_up_to_the_context ("--max-new-tokens beyond the context warns and
# stops there") and test_http_over_long_prompt_streamed_is_refused_before_the_stream
# ("over-long prompt, stream").
#
# Changed from the sweep, which counted any clear error: the pipeline and ``compress.run`` cases
# here set eval.seqlen=64 (and calib.seqlen=64), since the recipes' 2,048 is past the tiny
# model's 128 positions and was refused first (the sweep's empty, whitespace, not-UTF-8 and
# damaged-folder cases never reached their input); "eval.seqlen longer than the text" uses 100
# (the sweep's 4096 met the same position check); and every message must name the input.
#
# pipeline CLI
#   hydra.run.dir=/proc/x, hydra.run.dir under a file, model.path unknown model_type
#       test_bad_input.py::test_unknown_model_type_and_unwritable_run_dirs
#   data.eval.source empty file
#       test_bad_input.py::test_an_empty_eval_text_fails_before_the_model_loads
#   data.eval.source missing, rtn.bits=9, eval.device=tpu
#       test_bad_input.py::test_config_errors_leave_no_run_folder
#   eval.seqlen=-1
#       test_overrides_robust.py::test_bad_override_is_one_paragraph_before_the_model_loads
#       [eval.seqlen=1] (the same rule, "eval.seqlen takes an integer >= 2")
# decoder CLI
#   config.json unknown model_type
#       test_bad_input.py::test_unknown_model_type_and_unwritable_run_dirs
#   --device cuda (no GPU) / --device cuda:99 (GPU), --device tpu9
#       test_bad_input.py::test_devices_and_ports_are_checked_before_loading
#   --temperature -1, --temperature nan, --top-p 2, --temperature 0.7 --top-p 0, --top-k 0,
#   --seed 2**70, --seed -1, --max-new-tokens 0, --max-new-tokens -1, --threads 0
#       test_bad_input.py::test_sampling_settings_are_refused_alike_by_cli_api_and_server
#   damaged weight_packed (manifest), damaged folder with --no-verify runs
#       test_manifest_verify.py::test_decoder_cli_refuses_a_damaged_folder_and_runs_it_with_no_verify
# server CLI
#   --port 99999, --device tpu9
#       test_bad_input.py::test_devices_and_ports_are_checked_before_loading
# Also run by tests that check only the exit status and the message (kept here for the one
# paragraph without a traceback): folder does not exist, empty prompt
# (test_decoder.py::test_cli_json_and_errors); --skip without --draft
# (test_speculative.py::test_cli); --iam missing folder (test_iam.py::test_iam_generate_cli).
# HTTP (the body limits and timeouts run against test_serve_limits.py's small limits; the server
# here has the defaults)
#   seed 2**64; seed 2**64, stream
#       test_serve_limits.py::test_a_huge_seed_gets_400_before_any_stream
#   body over the limit (Content-Length), chunked body over the limit
#       test_serve_limits.py::test_a_body_over_the_limit_gets_413
#   Content-Length longer than the body
#       test_serve_limits.py::test_a_content_length_longer_than_the_body_times_out
#   256 KiB header
#       test_serve_limits.py::test_an_oversized_header_is_refused_by_h11
#   content-type text/plain, content-type form-urlencoded
#       test_serve_limits.py::test_a_body_that_is_not_json_gets_the_openai_error
#   temperature 'hot', top_p 1.5, max_tokens 0, invalid JSON, JSON array body, prompt token
#   outside the vocabulary, model missing, unknown model, messages empty, message role wizard,
#   five stop strings, n 2, prompt + max_tokens over the context, GET /v1/completions, unknown
#   route
#       test_serve.py::test_bad_requests_get_openai_errors
# API
#   quantize(nn.Linear(64, 64), RTNConfig), save(nn.Linear, folder), save(model, a file),
#   save(model, under a file), save(model, /proc/x)
#       test_bad_input.py::test_api_refuses_what_is_not_a_model_and_paths_it_cannot_write
#   quantize an already quantized model
#       test_overrides_robust.py::test_quantizing_twice_is_refused_naming_the_quantized_layer
#   Sampling(temperature=-1), Sampling(temperature=0.7, top_p=0), Sampling(seed=2**70),
#   Sampling(top_k=0)
#       test_bad_input.py::test_sampling_settings_are_refused_alike_by_cli_api_and_server

import json
import shutil
import socket
from types import SimpleNamespace

import httpx
import pytest
import torch

import compress
from compress.decoder.model import load
from compress.decoder.sampling import Sampling
from compress.errors import CompressError
from compress.serve.app import create_app
from compress.serve.engine import Engine
from compress.serve.worker import Worker
from compress.testing import overwrite, random_model, run_folder, tiny_config, tiny_tokenizer
from tests.conftest import serve_in_thread
from tests.test_bad_input import in_process

W = "model.safetensors"
TEMPLATE = (  # a chat template, so the chat cases reach what they test
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


def one_paragraph(text: str) -> bool:
    """At most three lines (a CLI's bracketed configuration lines, then its error), no blank
    line, no traceback; progress bars (``%|``) left out."""
    lines = [ln for ln in text.strip().splitlines() if ln.strip() and "%|" not in ln]
    body = "\n".join(lines)
    return 0 < len(lines) <= 3 and "\n\n" not in text.strip() and len(body) < 1500


def assert_clear(r, needle: str) -> None:
    """Exit status 2, no traceback, one paragraph that names ``needle``."""
    text = (r.stdout + r.stderr).strip()
    assert "Traceback" not in text, text
    assert r.returncode == 2, (r.returncode, text[-2000:])
    assert one_paragraph(text), text
    assert needle in text, text


def _edit_json(path, **fields):
    data = json.loads(path.read_text())
    data.update(fields)
    path.write_text(json.dumps({k: v for k, v in data.items() if v is not None}))


def _nan_weight(folder):
    from safetensors.torch import load_file, save_file

    sd = load_file(str(folder / W))
    sd[next(k for k in sd if k.endswith("q_proj.weight"))][0, 0] = float("nan")
    save_file(sd, str(folder / W), metadata={"format": "pt"})


def _truncate(folder):
    data = (folder / W).read_bytes()
    (folder / W).write_bytes(data[: len(data) // 2])


def _drop_template(folder):
    (folder / "chat_template.jinja").unlink(missing_ok=True)
    _edit_json(folder / "tokenizer_config.json", chat_template=None)


@pytest.fixture(scope="module")
def fx(tmp_path_factory):
    """The folders and files of the cases, by name: ``hf`` (a plain HF folder: a pipeline
    source), ``run`` (an RTN run folder with a manifest), ``fp_run`` (an unquantized one), their
    damaged copies, and text files."""
    root = tmp_path_factory.mktemp("hostile")
    tok = tiny_tokenizer()
    tok.chat_template = TEMPLATE
    hf = root / "hf"
    random_model(tiny_config()).save_pretrained(hf)
    tok.save_pretrained(hf)
    run = run_folder(root / "run", random_model(tiny_config()), tok, rtn={"group_size": 16})
    fp_run = run_folder(root / "fp_run", random_model(tiny_config()), tok)
    f = dict(root=root, hf=hf, run=run, fp_run=fp_run, nope=root / "nope")

    def variant(name, base, edit):
        shutil.copytree(base, root / name)
        edit(root / name)
        f[name] = root / name

    qweight, scales = (
        "model.layers.0.self_attn.k_proj.weight_packed",
        "model.layers.1.mlp.down_proj.weight_scale",
    )
    variant("damaged", run, lambda d: overwrite(d / W, qweight))
    variant("damaged_scales", run, lambda d: overwrite(d / W, scales, b"\x00\x3c", 0))
    variant("damaged_embed", run, lambda d: overwrite(d / W, "model.embed_tokens.weight"))
    variant(
        "fp_damaged", fp_run, lambda d: overwrite(d / W, "model.layers.1.self_attn.v_proj.weight")
    )
    variant("truncated", run, _truncate)
    variant("truncated_raw", run, lambda d: (_truncate(d), (d / "manifest.json").unlink()))
    variant("nan", hf, _nan_weight)
    variant("bad_manifest", run, lambda d: (d / "manifest.json").write_text("{not json"))
    variant("missing_file", run, lambda d: (d / "tokenizer.json").unlink())
    variant("extra_st", run, lambda d: shutil.copyfile(d / W, d / "model-extra.safetensors"))
    variant("edited_config", run, lambda d: _edit_json(d / "config.json", rope_theta=1234.0))
    variant("no_weights", hf, lambda d: (d / W).unlink())
    variant("no_tokenizer", hf, lambda d: [p.unlink() for p in d.glob("tokenizer*")])
    variant("no_template", hf, _drop_template)
    cfg = json.loads((hf / "config.json").read_text())
    configs = {
        "cfg_invalid": '{"model_type": "llama",',
        "cfg_list": "[1, 2]",
        "cfg_unknown": json.dumps(dict(cfg, model_type="lama")),
        "cfg_notype": json.dumps({k: v for k, v in cfg.items() if k != "model_type"}),
        "cfg_field": json.dumps(dict(cfg, hidden_size="big")),
        "cfg_gpt2": json.dumps({"model_type": "gpt2"}),
    }
    for name, text in configs.items():
        variant(name, hf, lambda d, text=text: (d / "config.json").write_text(text))
    variant("cfg_binary", hf, lambda d: (d / "config.json").write_bytes(b"\xff\xfe\x00garbage"))
    (root / "empty_dir").mkdir()
    f["empty_dir"] = root / "empty_dir"
    f["afile"] = root / "a_file.txt"
    f["afile"].write_text("not a folder")
    texts = {"empty": "", "blank": "\n\n   \n", "short": "a short text of a few words. " * 3}
    for name, text in texts.items():
        f[f"{name}_txt"] = root / f"{name}.txt"
        f[f"{name}_txt"].write_text(text)
    f["binary_txt"] = root / "binary.txt"
    f["binary_txt"].write_bytes(b"\xff\xfe\xfa" * 100)
    return SimpleNamespace(tok=tok, **f)


def fill(args, fx) -> list[str]:
    """``args`` with ``{name}`` replaced by the path of ``fx``'s folder or file of that name."""
    return [a.format(**{k: v for k, v in vars(fx).items() if k != "tok"}) for a in args]


@pytest.fixture(autouse=True)
def in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # a relative outputs/ lands in the test's temporary folder


# --- the pipeline CLI: exit 2, one paragraph naming the input, no run folder ------------------

PIPELINE = [  # (name, recipe, overrides, what the message names)
    (
        "hydra.run.dir is a file",
        "rtn_int4",
        ["model.path={hf}", "hydra.run.dir={afile}"],
        "{afile}",
    ),
    ("hydra.run.dir not empty", "rtn_int4", ["model.path={hf}", "hydra.run.dir={hf}"], "{hf}"),
    ("model.path config.json not JSON", "rtn_int4", ["model.path={cfg_invalid}"], "config.json"),
    ("model.path config.json a list", "rtn_int4", ["model.path={cfg_list}"], "config.json"),
    ("model.path config.json not UTF-8", "rtn_int4", ["model.path={cfg_binary}"], "config.json"),
    ("model.path without model_type", "rtn_int4", ["model.path={cfg_notype}"], "model_type"),
    ("model.path field of the wrong kind", "rtn_int4", ["model.path={cfg_field}"], "hidden_size"),
    ("model.path gpt2", "rtn_int4", ["model.path={cfg_gpt2}"], "gpt2"),
    ("model.path does not exist", "rtn_int4", ["model.path={nope}"], "{nope}"),
    ("model.path a file", "rtn_int4", ["model.path={afile}"], "{afile}"),
    ("model.path quantized run folder", "rtn_int4", ["model.path={run}"], "already quantized"),
    (
        "model.path damaged run folder (manifest)",
        "rtn_int4",
        ["model.path={fp_damaged}"],
        "v_proj.weight",
    ),
    ("model.path no tokenizer", "rtn_int4", ["model.path={no_tokenizer}"], "tokenizer"),
    (
        "data.eval.source whitespace only",
        "rtn_int4",
        ["model.path={hf}", "data.eval.source={blank_txt}"],
        "data.eval.source",
    ),
    (
        "data.eval.source not UTF-8",
        "rtn_int4",
        ["model.path={hf}", "data.eval.source={binary_txt}"],
        "data.eval.source",
    ),
    (
        "data.eval.source a folder",
        "rtn_int4",
        ["model.path={hf}", "data.eval.source={root}"],
        "data.eval.source",
    ),
    (
        "eval.windows more than the text holds",
        "rtn_int4",
        ["model.path={hf}", "data.eval.source={short_txt}", "eval.seqlen=16", "eval.windows=50"],
        "eval.windows",
    ),
    (
        "eval.seqlen longer than the text",
        "rtn_int4",
        ["model.path={hf}", "data.eval.source={short_txt}", "eval.seqlen=100", "eval.windows=1"],
        "eval.seqlen=100",
    ),
    (
        "awq: data.calib.source empty",
        "awq_int4",
        ["model.path={hf}", "data.calib.source={empty_txt}"],
        "data.calib.source",
    ),
    (
        "awq: calibration too short",
        "awq_int4",
        ["model.path={hf}", "data.calib.source={short_txt}", "calib.samples=64", "calib.seqlen=64"],
        "calib.samples",
    ),
    ("rtn.group_size=48", "rtn_int4", ["model.path={hf}", "rtn.group_size=48"], "group_size"),
    ("eval.windows=0", "rtn_int4", ["model.path={hf}", "eval.windows=0"], "eval.windows"),
    ("unknown key", "rtn_int4", ["model.path={hf}", "rtn.bitz=4"], "rtn.bitz"),
    ("unknown recipe", "nope", ["model.path={hf}"], "nope"),
    ("model.dtype=int8", "rtn_int4", ["model.path={hf}", "model.dtype=int8"], "model.dtype"),
    ("decode.kv=bogus", "rtn_int4", ["model.path={hf}", "decode.kv=bogus"], "decode.kv"),
    ("decode.threads=0", "rtn_int4", ["model.path={hf}", "decode.threads=0"], "decode.threads"),
    ("override syntax error", "rtn_int4", ["model.path={hf}", "eval.windows=[1,"], "eval.windows"),
]


def within_positions(overrides: list[str]) -> list[str]:
    """``eval.seqlen`` and ``calib.seqlen`` within the tiny model's 128 positions, unless the
    case sets them (the recipes' 2,048 would be refused before the input the case tries)."""
    given = {o.split("=", 1)[0] for o in overrides}
    return [o for o in ("eval.seqlen=64", "calib.seqlen=64") if o.split("=")[0] not in given]


@pytest.mark.parametrize("name, recipe, overrides, needle", PIPELINE, ids=[c[0] for c in PIPELINE])
def test_pipeline_cli(fx, tmp_path, name, recipe, overrides, needle):
    overrides = fill(overrides, fx)
    given = [o.split("=", 1)[1] for o in overrides if o.startswith("hydra.run.dir=")]
    out = tmp_path / "run"
    args = [f"recipe={recipe}", *within_positions(overrides), *overrides]
    args += [] if given else [f"hydra.run.dir={out}"]
    r = in_process("compress", *args)
    assert_clear(r, *fill([needle], fx))
    if not given:
        assert not out.exists()


# --- the decoder CLI: exit 2, one paragraph naming the input ----------------------------------

SHORT = ["--max-new-tokens", "2", "--no-warmup", "--device", "cpu", "--dtype", "float32"]
PROMPT = ["--prompt", "the quick"]

DECODER_FOLDERS = [  # (name, folder, extra arguments, what the message names)
    ("folder does not exist", "{nope}", [], "{nope}"),
    ("folder is a file", "{afile}", [], "{afile}"),
    ("empty folder", "{empty_dir}", [], "{empty_dir}"),
    ("config.json not JSON", "{cfg_invalid}", [], "config.json"),
    ("config.json a JSON list", "{cfg_list}", [], "config.json"),
    ("config.json not UTF-8", "{cfg_binary}", [], "config.json"),
    ("config.json without model_type", "{cfg_notype}", [], "model_type"),
    ("config.json field of the wrong kind", "{cfg_field}", [], "hidden_size"),
    ("unsupported architecture (gpt2)", "{cfg_gpt2}", [], "gpt2"),
    ("no safetensors", "{no_weights}", [], "safetensors"),
    ("truncated safetensors, no manifest", "{truncated_raw}", [], "corrupt or truncated"),
    ("truncated safetensors, manifest", "{truncated}", [], W),
    ("damaged scales (manifest)", "{damaged_scales}", [], "down_proj.weight_scale"),
    ("damaged embedding (manifest)", "{damaged_embed}", [], "embed_tokens.weight"),
    ("NaN weight, no manifest", "{nan}", [], "NaN"),
    ("manifest.json not JSON", "{bad_manifest}", [], "manifest.json"),
    ("file listed in the manifest missing", "{missing_file}", [], "tokenizer.json"),
    ("extra safetensors file", "{extra_st}", [], "model-extra.safetensors"),
    ("config.json edited after the run", "{edited_config}", [], "config.json"),
    ("no tokenizer files", "{no_tokenizer}", [], "tokenizer"),
    ("--chat without a chat template", "{no_template}", ["--chat"], "--chat"),
    ("--draft missing folder", "{run}", ["--draft", "{nope}"], "{nope}"),
    ("--draft damaged folder", "{run}", ["--draft", "{damaged}"], "k_proj.weight_packed"),
    ("--iam missing folder", "{run}", ["--iam", "{nope}"], "compress.cli.iam generate"),
]


@pytest.mark.parametrize(
    "name, folder, extra, needle", DECODER_FOLDERS, ids=[c[0] for c in DECODER_FOLDERS]
)
def test_decoder_cli_folder(fx, name, folder, extra, needle):
    r = in_process("compress.decoder", *fill([folder, *PROMPT, *SHORT, *extra], fx))
    assert_clear(r, *fill([needle], fx))


DECODER_FLAGS = [  # (name, flags, what the message names) on the RTN run folder
    ("--temperature inf", ["--temperature", "inf"], "--temperature"),
    ("--temperature 5", ["--temperature", "5"], "--temperature"),
    ("--temperature abc", ["--temperature", "abc"], "--temperature"),
    ("--top-p -0.5", ["--top-p", "-0.5"], "--top-p"),
    ("--top-k -3", ["--top-k", "-3"], "--top-k"),
    ("--stop given five times", [a for s in "abcde" for a in ("--stop", s)], "--stop"),
    ("--threads -2", ["--threads", "-2"], "--threads"),
    ("--threads 100000", ["--threads", "100000"], "--threads"),
    ("--max-len 0", ["--max-len", "0"], "--max-len"),
    ("--max-len shorter than the prompt", ["--max-len", "1"], "--max-len"),
    ("--device cuda:7", ["--device", "cuda:7"], "--device cuda:7"),
    ("--device ''", ["--device", ""], "--device"),
    ("--kv-opt without =", ["--kv-opt", "bits"], "--kv-opt"),
    ("--kv bogus", ["--kv", "bogus"], "--kv"),
    ("--kv kivi --kv-opt bits=abc", ["--kv", "kivi", "--kv-opt", "bits=abc"], "bits=abc"),
    ("--kv kivi --kv-opt unknown option", ["--kv", "kivi", "--kv-opt", "nosuch=1"], "nosuch"),
    ("prompt longer than the context", ["--prompt", "fox " * 300], "prompt"),
    ("--dtype int3", ["--dtype", "int3"], "--dtype"),
    ("--head int2", ["--head", "int2"], "--head"),
    ("--gamma bogus", ["--draft", "self", "--gamma", "x"], "--gamma"),
    ("--skip without --draft", ["--skip", "2"], "--skip"),
    ("empty prompt", ["--prompt", ""], "prompt"),
    ("--stop empty string", ["--stop", ""], "--stop"),
]


@pytest.mark.parametrize("name, flags, needle", DECODER_FLAGS, ids=[c[0] for c in DECODER_FLAGS])
def test_decoder_cli_flags(fx, name, flags, needle):
    argv = [str(fx.run), *PROMPT, "--no-warmup", "--dtype", "float32", *flags]
    if "--device" not in flags:
        argv += ["--device", "cpu"]
    r = in_process("compress.decoder", *argv, "--max-new-tokens", "2")
    assert_clear(r, needle)


def test_decoder_cli_generates_up_to_the_context(fx):
    """``--max-new-tokens`` beyond the context: a warning that says where generation stops, and
    exit 0 (not a refusal)."""
    argv = [str(fx.run), *PROMPT, "--no-warmup", "--device", "cpu", "--dtype", "float32"]
    with pytest.warns(UserWarning, match="generation stops after"):
        r = in_process("compress.decoder", *argv, "--max-new-tokens", "100000")
    assert r.returncode in (0, None) and "Traceback" not in r.stderr, r.stderr[-2000:]


# --- the server CLI: exit 2, one paragraph naming the input, before it serves -----------------


@pytest.fixture(scope="module")
def busy_port():
    """A port something else listens on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        yield s.getsockname()[1]


SERVE_CLI = [  # (name, folder, flags, what the message names)
    ("--port -1", "{run}", ["--port", "-1"], "--port"),
    ("--port in use", "{run}", ["--port", "{busy}"], "{busy}"),
    ("--host unresolvable", "{run}", ["--host", "no-such-host.invalid"], "no-such-host.invalid"),
    ("--host 8.8.8.8 (not this machine)", "{run}", ["--host", "8.8.8.8", "--port", "0"], "8.8.8.8"),
    ("--device cuda:7", "{run}", ["--device", "cuda:7"], "--device cuda:7"),
    ("--threads 0", "{run}", ["--threads", "0"], "--threads"),
    ("--num-blocks 0", "{run}", ["--num-blocks", "0"], "--num-blocks"),
    ("--block-size 0", "{run}", ["--block-size", "0"], "--block-size"),
    ("--max-seqs 0", "{run}", ["--max-seqs", "0"], "--max-seqs"),
    ("--max-step-tokens -1", "{run}", ["--max-step-tokens", "-1"], "--max-step-tokens"),
    ("--max-body-bytes 0", "{run}", ["--max-body-bytes", "0"], "--max-body-bytes"),
    ("--body-timeout 0", "{run}", ["--body-timeout", "0"], "--body-timeout"),
    ("--log-level loud", "{run}", ["--log-level", "loud"], "--log-level"),
    ("--port abc", "{run}", ["--port", "abc"], "--port"),
    ("folder does not exist", "{nope}", [], "{nope}"),
    ("damaged folder (manifest)", "{damaged}", [], "k_proj.weight_packed"),
    ("config.json unknown model_type", "{cfg_unknown}", ["--port", "0"], "lama"),
    ("no safetensors", "{no_weights}", ["--port", "0"], "safetensors"),
    ("no tokenizer", "{no_tokenizer}", ["--port", "0"], "tokenizer"),
]


@pytest.mark.parametrize("name, folder, flags, needle", SERVE_CLI, ids=[c[0] for c in SERVE_CLI])
def test_serve_cli(fx, busy_port, name, folder, flags, needle):
    values = [a.replace("{busy}", str(busy_port)) for a in [folder, *flags, needle]]
    *argv, needle = fill(values, fx)
    assert_clear(in_process("compress.serve", *argv), needle)


# --- HTTP requests to the server: the status, an OpenAI error body, still serving --------------


@pytest.fixture(scope="module")
def server(fx):
    """The app over the RTN run folder on 127.0.0.1 (as ``compress.serve`` runs it), in a
    thread."""
    model, tok = load(fx.run)
    engine = Engine(model, tok, num_blocks=64, block_size=4, max_seqs=4, max_step_tokens=64)
    with serve_in_thread(create_app(Worker(engine), tok, "tiny")) as url:
        yield url


C = {"model": "tiny", "prompt": "the quick"}
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}
IMAGE = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]
JSON = {"content-type": "application/json"}
HTTP = [  # (name, method, path, JSON body or raw bytes, status, what the message names)
    ("seed 2**70 (chat)", "post", "/v1/chat/completions", dict(CHAT, seed=2**70), 400, "seed"),
    ("seed -1", "post", "/v1/completions", dict(C, seed=-1), 400, "seed"),
    ("temperature -1", "post", "/v1/completions", dict(C, temperature=-1), 400, "temperature"),
    ("temperature 3", "post", "/v1/completions", dict(C, temperature=3), 400, "temperature"),
    (
        "temperature NaN (raw JSON)",
        "post",
        "/v1/completions",
        b'{"model":"tiny","prompt":"hi","temperature":NaN}',
        400,
        "temperature",
    ),
    (
        "temperature Infinity (raw JSON)",
        "post",
        "/v1/completions",
        b'{"model":"tiny","prompt":"hi","temperature":Infinity}',
        400,
        "temperature",
    ),
    ("top_p 0", "post", "/v1/completions", dict(C, top_p=0), 400, "top_p"),
    ("top_k 0", "post", "/v1/completions", dict(C, top_k=0), 400, "top_k"),
    ("top_k -2", "post", "/v1/completions", dict(C, top_k=-2), 400, "top_k"),
    ("max_tokens -5", "post", "/v1/completions", dict(C, max_tokens=-5), 400, "max_tokens"),
    ("max_tokens 2**70", "post", "/v1/completions", dict(C, max_tokens=2**70), 400, "max_tokens"),
    (
        "max_completion_tokens 0",
        "post",
        "/v1/chat/completions",
        dict(CHAT, max_completion_tokens=0),
        400,
        "max_completion_tokens",
    ),
    ("empty body", "post", "/v1/completions", b"", 400, "body"),
    ("prompt a number", "post", "/v1/completions", dict(C, prompt=5), 400, "prompt"),
    ("prompt a list of lists", "post", "/v1/completions", dict(C, prompt=[[1, 2]]), 400, "prompt"),
    ("prompt negative token", "post", "/v1/completions", dict(C, prompt=[-1]), 400, "-1"),
    ("prompt empty string", "post", "/v1/completions", dict(C, prompt=""), 400, "prompt"),
    ("prompt empty list", "post", "/v1/completions", dict(C, prompt=[]), 400, "prompt"),
    ("two prompts", "post", "/v1/completions", dict(C, prompt=["a", "b"]), 400, "prompt"),
    ("image content part", "post", "/v1/chat/completions", dict(CHAT, messages=IMAGE), 400, "text"),
    (
        "max_tokens -1 (chat)",
        "post",
        "/v1/chat/completions",
        dict(CHAT, max_tokens=-1),
        400,
        "max_tokens",
    ),
    ("empty stop string", "post", "/v1/completions", dict(C, stop=[""]), 400, "stop"),
    ("echo true", "post", "/v1/completions", dict(C, echo=True), 400, "echo"),
    ("logprobs 5", "post", "/v1/completions", dict(C, logprobs=5), 400, "logprobs"),
    (
        "presence_penalty 1",
        "post",
        "/v1/completions",
        dict(C, presence_penalty=1),
        400,
        "presence_penalty",
    ),
    (
        "stream_options not an object",
        "post",
        "/v1/completions",
        dict(C, stream_options=5),
        400,
        "stream_options",
    ),
]


def assert_openai_error(r: httpx.Response, status: int, needle: str, url: str) -> None:
    assert r.status_code == status, r.text
    assert "Traceback" not in r.text, r.text
    err = r.json()["error"]
    assert isinstance(err.get("message"), str) and err["message"] and "type" in err, err
    assert needle in err["message"], err
    assert httpx.get(url + "/health", timeout=10).status_code == 200  # still serving


@pytest.mark.parametrize("name, method, path, body, status, needle", HTTP, ids=[c[0] for c in HTTP])
def test_http_request(server, name, method, path, body, status, needle):
    if isinstance(body, bytes):
        kw = dict(content=body, headers=JSON)
    else:
        kw = dict(json=body)
    r = getattr(httpx, method)(server + path, timeout=10, **kw)
    assert_openai_error(r, status, needle, server)


def test_http_over_long_prompt_streamed_is_refused_before_the_stream(server):
    """An over-long prompt with ``stream: true`` gets the 400 and error body, not a stream."""
    body = dict(C, prompt="fox " * 300, stream=True)
    with httpx.stream("POST", server + "/v1/completions", json=body, timeout=10) as r:
        r.read()
    assert_openai_error(r, 400, "context", server)


# --- the Python API: a one-paragraph CompressError naming the input ---------------------------

RTN = compress.RTNConfig(bits=4, group_size=64)
AWQ = compress.AWQConfig(group_size=16)
SEQLEN = "eval.seqlen=64"  # within the tiny model's 128 positions, so the run reaches the case


def model():
    return random_model(tiny_config())


def full_folder(fx):
    folder = fx.root / "full"
    folder.mkdir(exist_ok=True)
    (folder / "x").write_text("x")
    return folder


API = [  # (name, call(fx, tmp_path), what the message names, a folder it must not leave)
    ("quantize(None, RTNConfig)", lambda fx, t: compress.quantize(None, RTN), "None", None),
    ("quantize(model, 'rtn')", lambda fx, t: compress.quantize(model(), "rtn"), "not str", None),
    (
        "quantize(model, RTNConfig(bits=9))",
        lambda fx, t: compress.quantize(model(), compress.RTNConfig(bits=9)),
        "bits",
        None,
    ),
    (
        "quantize(model, RTNConfig(group_size=48))",
        lambda fx, t: compress.quantize(model(), compress.RTNConfig(group_size=48)),
        "48",
        None,
    ),
    (
        "quantize(model, AWQConfig()) without tokenizer",
        lambda fx, t: compress.quantize(model(), compress.AWQConfig()),
        "tokenizer",
        None,
    ),
    (
        "save(model, a folder with files)",
        lambda fx, t: compress.save(model(), full_folder(fx)),
        "full",
        None,
    ),
    (
        "save(model, folder, tokenizer='tok')",
        lambda fx, t: compress.save(model(), t / "out", tokenizer="tok"),
        "tokenizer",
        "out",
    ),
    ("save(model, None)", lambda fx, t: compress.save(model(), None), "None", None),
    ("run('nope')", lambda fx, t: compress.run("nope"), "nope", None),
    ("run(123)", lambda fx, t: compress.run(123), "int", None),
    ("run(recipe, 5)", lambda fx, t: compress.run("rtn_int4", 5), "5", None),
    (
        "run with unknown model_type",
        lambda fx, t: compress.run("rtn_int4", model=fx.cfg_unknown, out=t / "out"),
        "lama",
        "out",
    ),
    (
        "run into /proc/x",
        lambda fx, t: compress.run("rtn_int4", model=fx.hf, out="/proc/x"),
        "/proc/x",
        None,
    ),
    (
        "run with an empty eval text",
        lambda fx, t: compress.run(
            "rtn_int4",
            SEQLEN,
            model=fx.hf,
            out=t / "out",
            data={"eval": {"source": str(fx.empty_txt)}},
        ),
        "empty",
        "out",
    ),
    (
        "run on a damaged run folder",
        lambda fx, t: compress.run("fp", SEQLEN, model=fx.fp_damaged, out=t / "out"),
        "v_proj.weight",
        "out",
    ),
    (
        "run with eval={'windows': -1}",
        lambda fx, t: compress.run("rtn_int4", model=fx.hf, out=t / "out", eval={"windows": -1}),
        "eval.windows",
        "out",
    ),
    (
        "run with an unknown setting",
        lambda fx, t: compress.run("rtn_int4", model=fx.hf, out=t / "out", evaluation={"w": 1}),
        "evaluation",
        "out",
    ),
    (
        "quantize(AWQ) with 1-D calibration ids",
        lambda fx, t: compress.quantize(
            model(), AWQ, tokenizer=fx.tok, calibration=torch.zeros(8, dtype=torch.long)
        ),
        "calibration",
        None,
    ),
    (
        "quantize(AWQ) with float calibration",
        lambda fx, t: compress.quantize(
            model(), AWQ, tokenizer=fx.tok, calibration=torch.rand(2, 16)
        ),
        "calibration",
        None,
    ),
    (
        "quantize(AWQ) with ids outside the vocabulary",
        lambda fx, t: compress.quantize(
            model(), AWQ, tokenizer=fx.tok, calibration=torch.full((2, 16), 10**6)
        ),
        "calibration",
        None,
    ),
    (
        "quantize(AWQ) with an empty calibration file",
        lambda fx, t: compress.quantize(
            model(), AWQ, tokenizer=fx.tok, calibration=str(fx.empty_txt)
        ),
        "empty",
        None,
    ),
    (
        "quantize(AWQ) with a calibration file too short",
        lambda fx, t: compress.quantize(
            model(), AWQ, tokenizer=fx.tok, calibration=str(fx.short_txt)
        ),
        "short.txt",
        None,
    ),
    ("Sampling(temperature='hot')", lambda fx, t: Sampling(temperature="hot"), "temperature", None),
]


@pytest.mark.parametrize("name, call, needle, leftover", API, ids=[c[0] for c in API])
def test_api(fx, tmp_path, capsys, name, call, needle, leftover):
    with pytest.raises(CompressError) as e:
        call(fx, tmp_path)
    capsys.readouterr()  # what the call printed before refusing
    assert one_paragraph(str(e.value)), str(e.value)
    assert needle in str(e.value), str(e.value)
    if leftover:
        assert not (tmp_path / leftover).exists()
