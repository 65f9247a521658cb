"""Hostile inputs across the four surfaces, each checked for a clear error: the cases of
``tests/test_hostile_sweep.py``.

Surfaces: the pipeline CLI (``python -m compress``), the decoder CLI (``python -m
compress.decoder``), the server (its CLI, and HTTP requests to it) and the Python API
(``compress.run/quantize/save``, ``Sampling``). Everything runs in this process against tiny
random run folders built in a temporary folder (no real model); the CLIs' ``main`` is called
with the arguments a shell would pass, stdout and stderr captured.

A case passes ("clear") when:
- a CLI exits with status 2 (1 for argparse's own usage errors is not accepted: argparse exits
  2 too), prints no traceback, prints one paragraph, and leaves no ``hydra.run.dir`` behind;
- an HTTP request gets the status asked for with an OpenAI error body
  (``{"error": {"message": ...}}``), and the server still answers ``/health``;
- an API call raises ``CompressError`` whose message is one paragraph;
- a case marked ``ok`` (e.g. ``--no-verify`` on an edited folder) succeeds.
The script prints the count of clear cases and lists every other one with what happened.
"""

import contextlib
import io
import json
import re
import shutil
import socket
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch


@dataclass
class Case:
    surface: str  # pipeline | decoder | serve-cli | http | api
    name: str
    run: object  # () -> (clear: bool, detail: str)
    quick: bool = False


def one_paragraph(text: str) -> bool:
    lines = [ln for ln in text.strip().splitlines() if ln.strip() and "%|" not in ln]
    body = "\n".join(lines)
    return bool(body) and "\n\n" not in text.strip() and len(body) < 1500 and len(lines) <= 3


def capture(fn):
    """Run ``fn`` with stdout/stderr captured: (exit code or 'exception', text, traceback)."""
    out = io.StringIO()
    code, tb = 0, ""
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        try:
            fn()
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        except BaseException:  # noqa: BLE001 - that is what the sweep looks for
            code, tb = "exception", traceback.format_exc()
    return code, out.getvalue(), tb


def judge_cli(code, text, tb, expect: str = "error", leftover: Path | None = None):
    if expect == "ok":
        return code == 0 and not tb, f"exit {code}: {(tb or text).strip()[-300:]}"
    if tb or "Traceback" in text:
        last = (tb or text).strip().splitlines()[-1]
        return False, f"traceback: {last[:200]}"
    if code != 2:
        return False, f"exit {code}: {text.strip()[-200:]}"
    if leftover is not None and leftover.exists():
        return False, f"left {leftover} behind"
    if not one_paragraph(text):
        return False, f"not one paragraph: {text.strip()[:300]!r}"
    return True, text.strip().splitlines()[-1][:160]


# ------------------------------------------------------------------------------------ fixtures


class Fixtures:
    """Tiny folders in a temporary directory."""

    def __init__(self, root: Path):
        from compress.testing import (
            overwrite,
            random_model,
            run_folder,
            tiny_config,
            tiny_tokenizer,
        )

        self.root = root
        tok = tiny_tokenizer()
        tok.chat_template = (  # so the chat cases reach what they test
            "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}"
        )
        self.tok = tok
        self.hf = root / "hf"  # a plain HF folder (a pipeline source)
        random_model(tiny_config()).save_pretrained(self.hf)
        tok.save_pretrained(self.hf)
        self.run = run_folder(
            root / "run", random_model(tiny_config()), tok, rtn={"group_size": 16}
        )
        self.fp_run = run_folder(root / "fp_run", random_model(tiny_config()), tok)  # a source
        w = "model.safetensors"

        def variant(name, base=None, edit=None):
            dst = root / name
            shutil.copytree(base or self.run, dst)
            if edit:
                edit(dst)
            return dst

        self.damaged = variant(
            "damaged", edit=lambda d: overwrite(d / w, "model.layers.0.self_attn.k_proj.qweight")
        )
        self.damaged_scales = variant(
            "damaged_scales",
            edit=lambda d: overwrite(d / w, "model.layers.1.mlp.down_proj.scales", b"\x00\x3c", 0),
        )
        self.damaged_embed = variant(
            "damaged_embed", edit=lambda d: overwrite(d / w, "model.embed_tokens.weight")
        )
        self.fp_damaged = variant(
            "fp_damaged",
            self.fp_run,
            lambda d: overwrite(d / w, "model.layers.1.self_attn.v_proj.weight"),
        )

        def truncate(d, keep=0.5):
            data = (d / w).read_bytes()
            (d / w).write_bytes(data[: int(len(data) * keep)])

        self.truncated = variant("truncated", edit=truncate)
        self.truncated_raw = variant(
            "truncated_raw", edit=lambda d: (truncate(d), (d / "manifest.json").unlink())
        )
        self.no_manifest_nan = variant("nan", self.hf, self._nan)
        self.bad_manifest = variant(
            "bad_manifest", edit=lambda d: (d / "manifest.json").write_text("{not json")
        )
        self.missing_file = variant("missing_file", edit=lambda d: (d / "tokenizer.json").unlink())
        self.extra_st = variant(
            "extra_st", edit=lambda d: shutil.copyfile(d / w, d / "model-extra.safetensors")
        )
        self.edited_config = variant("edited_config", edit=self._edit_config)
        self.empty_dir = root / "empty_dir"
        self.empty_dir.mkdir()
        self.no_weights = variant("no_weights", self.hf, lambda d: (d / w).unlink())
        self.no_tokenizer = variant(
            "no_tokenizer",
            self.hf,
            lambda d: [p.unlink() for p in d.glob("tokenizer*")],
        )

        def drop_template(d):
            (d / "chat_template.jinja").unlink(missing_ok=True)
            c = json.loads((d / "tokenizer_config.json").read_text())
            c.pop("chat_template", None)
            (d / "tokenizer_config.json").write_text(json.dumps(c))

        self.no_template = variant("no_template", self.hf, drop_template)

        def config_variant(name, text):
            return variant(name, self.hf, lambda d: (d / "config.json").write_text(text))

        cfg = json.loads((self.hf / "config.json").read_text())
        self.cfg_invalid = config_variant("cfg_invalid", '{"model_type": "llama",')
        self.cfg_list = config_variant("cfg_list", "[1, 2]")
        self.cfg_unknown = config_variant("cfg_unknown", json.dumps(dict(cfg, model_type="lama")))
        self.cfg_notype = config_variant(
            "cfg_notype", json.dumps({k: v for k, v in cfg.items() if k != "model_type"})
        )
        self.cfg_field = config_variant("cfg_field", json.dumps(dict(cfg, hidden_size="big")))
        self.cfg_gpt2 = config_variant("cfg_gpt2", json.dumps({"model_type": "gpt2"}))
        self.cfg_binary = config_variant("cfg_binary", "")
        (self.cfg_binary / "config.json").write_bytes(b"\xff\xfe\x00garbage")
        self.afile = root / "a_file.txt"
        self.afile.write_text("not a folder")
        t = root / "texts"
        t.mkdir()
        self.empty_txt = t / "empty.txt"
        self.empty_txt.write_text("")
        self.blank_txt = t / "blank.txt"
        self.blank_txt.write_text("\n\n   \n")
        self.binary_txt = t / "binary.txt"
        self.binary_txt.write_bytes(b"\xff\xfe\xfa" * 100)
        self.short_txt = t / "short.txt"
        self.short_txt.write_text("a short text of a few words. " * 3)

    @staticmethod
    def _nan(d):
        from safetensors.torch import load_file, save_file

        sd = load_file(str(d / "model.safetensors"))
        k = next(k for k in sd if k.endswith("q_proj.weight"))
        sd[k][0, 0] = float("nan")
        save_file(sd, str(d / "model.safetensors"), metadata={"format": "pt"})

    @staticmethod
    def _edit_config(d):
        c = json.loads((d / "config.json").read_text())
        c["rope_theta"] = 1234.0
        (d / "config.json").write_text(json.dumps(c))


# ------------------------------------------------------------------------------------ surfaces


def decoder_cases(fx: Fixtures) -> list[Case]:
    from compress.decoder.__main__ import main

    run = str(fx.run)

    def case(name, argv, expect="error", quick=False):
        def go():
            return judge_cli(*capture(lambda: main(argv)), expect=expect)

        return Case("decoder", name, go, quick)

    short = ["--max-new-tokens", "2", "--no-warmup", "--device", "cpu", "--dtype", "float32"]
    p = ["--prompt", "the quick"]
    folder_cases = [
        ("folder does not exist", str(fx.root / "nope")),
        ("folder is a file", str(fx.afile)),
        ("empty folder", str(fx.empty_dir)),
        ("config.json not JSON", str(fx.cfg_invalid)),
        ("config.json a JSON list", str(fx.cfg_list)),
        ("config.json not UTF-8", str(fx.cfg_binary)),
        ("config.json unknown model_type", str(fx.cfg_unknown)),
        ("config.json without model_type", str(fx.cfg_notype)),
        ("config.json field of the wrong kind", str(fx.cfg_field)),
        ("unsupported architecture (gpt2)", str(fx.cfg_gpt2)),
        ("no safetensors", str(fx.no_weights)),
        ("truncated safetensors, no manifest", str(fx.truncated_raw)),
        ("truncated safetensors, manifest", str(fx.truncated)),
        ("damaged qweight (manifest)", str(fx.damaged)),
        ("damaged scales (manifest)", str(fx.damaged_scales)),
        ("damaged embedding (manifest)", str(fx.damaged_embed)),
        ("NaN weight, no manifest", str(fx.no_manifest_nan)),
        ("manifest.json not JSON", str(fx.bad_manifest)),
        ("file listed in the manifest missing", str(fx.missing_file)),
        ("extra safetensors file", str(fx.extra_st)),
        ("config.json edited after the run", str(fx.edited_config)),
        ("no tokenizer files", str(fx.no_tokenizer)),
    ]
    quick_names = {"damaged qweight (manifest)", "config.json unknown model_type"}
    out = [case(n, [f] + p + short, quick=n in quick_names) for n, f in folder_cases]
    out.append(case("--chat without a chat template", [str(fx.no_template), "--chat"] + p + short))
    out.append(
        case(
            "damaged folder with --no-verify runs",
            [str(fx.damaged)] + p + short + ["--no-verify"],
            "ok",
        )
    )
    flag_cases = [
        ("--temperature -1", ["--temperature", "-1"]),
        ("--temperature nan", ["--temperature", "nan"]),
        ("--temperature inf", ["--temperature", "inf"]),
        ("--temperature 5", ["--temperature", "5"]),
        ("--temperature abc", ["--temperature", "abc"]),
        ("--top-p 2", ["--top-p", "2"]),
        ("--temperature 0.7 --top-p 0", ["--temperature", "0.7", "--top-p", "0"]),
        ("--top-p -0.5", ["--top-p", "-0.5"]),
        ("--top-k 0", ["--top-k", "0"]),
        ("--top-k -3", ["--top-k", "-3"]),
        ("--seed 2**70", ["--seed", str(2**70)]),
        ("--seed -1", ["--seed", "-1"]),
        ("--max-new-tokens 0", ["--max-new-tokens", "0"]),
        ("--max-new-tokens -1", ["--max-new-tokens", "-1"]),
        (
            "--stop given five times",
            ["--stop", "a", "--stop", "b", "--stop", "c", "--stop", "d", "--stop", "e"],
        ),
        ("--threads 0", ["--threads", "0"]),
        ("--threads -2", ["--threads", "-2"]),
        ("--threads 100000", ["--threads", "100000"]),
        ("--max-len 0", ["--max-len", "0"]),
        ("--max-len shorter than the prompt", ["--max-len", "1"]),
        (
            "--device cuda (no GPU)" if not torch.cuda.is_available() else "--device cuda:99",
            ["--device", "cuda" if not torch.cuda.is_available() else "cuda:99"],
        ),
        ("--device tpu9", ["--device", "tpu9"]),
        ("--device cuda:7", ["--device", "cuda:7"]),
        ("--device ''", ["--device", ""]),
        ("--kv-opt without =", ["--kv-opt", "bits"]),
        ("--kv bogus", ["--kv", "bogus"]),
        ("--kv kivi --kv-opt bits=abc", ["--kv", "kivi", "--kv-opt", "bits=abc"]),
        ("--kv kivi --kv-opt unknown option", ["--kv", "kivi", "--kv-opt", "nosuch=1"]),
        ("prompt longer than the context", ["--prompt", "fox " * 300]),
        ("--dtype int3", ["--dtype", "int3"]),
        ("--head int2", ["--head", "int2"]),
        ("--draft missing folder", ["--draft", str(fx.root / "nope")]),
        ("--draft damaged folder", ["--draft", str(fx.damaged)]),
        ("--iam missing folder", ["--iam", str(fx.root / "nope")]),
        ("--gamma bogus", ["--draft", "self", "--gamma", "x"]),
        ("--skip without --draft", ["--skip", "2"]),
        ("empty prompt", ["--prompt", ""]),
        ("--stop empty string", ["--stop", ""]),
    ]
    # generation stops at the model's context, with a warning that says so
    out.append(
        case(
            "--max-new-tokens beyond the context warns and stops there",
            [run]
            + p
            + [
                "--no-warmup",
                "--device",
                "cpu",
                "--dtype",
                "float32",
                "--max-new-tokens",
                "100000",
            ],
            "ok",
        )
    )
    quick_flags = {"--temperature -1", "--seed 2**70", "--device tpu9", "--max-new-tokens 0"}
    for n, extra in flag_cases:
        argv = [run] + p + ["--no-warmup", "--dtype", "float32"] + extra
        if "--max-new-tokens" not in extra:
            argv += ["--max-new-tokens", "2"]
        if "--device" not in extra:
            argv += ["--device", "cpu"]
        out.append(case(n, argv, quick=n in quick_flags))
    return out


def serve_cli_cases(fx: Fixtures) -> list[Case]:
    from compress.serve.__main__ import main

    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen(1)
    Fixtures.busy_socket = busy  # kept open for the sweep
    taken = busy.getsockname()[1]

    def case(name, argv, quick=False):
        return Case("serve-cli", name, lambda: judge_cli(*capture(lambda: main(argv))), quick)

    run = str(fx.run)
    return [
        case("--port 99999", [run, "--port", "99999"], quick=True),
        case("--port -1", [run, "--port", "-1"]),
        case("--port in use", [run, "--port", str(taken)], quick=True),
        case("--host unresolvable", [run, "--host", "no-such-host.invalid"]),
        case("--host 8.8.8.8 (not this machine)", [run, "--host", "8.8.8.8", "--port", "0"]),
        case("--device tpu9", [run, "--device", "tpu9"]),
        case("--device cuda:7", [run, "--device", "cuda:7"]),
        case("--threads 0", [run, "--threads", "0"]),
        case("--num-blocks 0", [run, "--num-blocks", "0"]),
        case("--block-size 0", [run, "--block-size", "0"]),
        case("--max-seqs 0", [run, "--max-seqs", "0"]),
        case("--max-step-tokens -1", [run, "--max-step-tokens", "-1"]),
        case("--max-body-bytes 0", [run, "--max-body-bytes", "0"]),
        case("--body-timeout 0", [run, "--body-timeout", "0"]),
        case("--log-level loud", [run, "--log-level", "loud"]),
        case("--port abc", [run, "--port", "abc"]),
        case("folder does not exist", [str(fx.root / "nope")]),
        case("damaged folder (manifest)", [str(fx.damaged)], quick=True),
        case("config.json unknown model_type", [str(fx.cfg_unknown), "--port", "0"]),
        case("no safetensors", [str(fx.no_weights), "--port", "0"]),
        case("no tokenizer", [str(fx.no_tokenizer), "--port", "0"]),
    ]


class Server:
    """The app over a tiny run folder on 127.0.0.1, in a thread (small limits: 64 KiB, 1 s)."""

    def __init__(self, folder):
        import uvicorn

        from compress.decoder.model import load
        from compress.serve.__main__ import H11_MAX_HEADER_BYTES
        from compress.serve.app import create_app
        from compress.serve.engine import Engine
        from compress.serve.worker import Worker

        model, tok = load(folder)
        engine = Engine(model, tok, num_blocks=64, block_size=4, max_seqs=4, max_step_tokens=64)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        app = create_app(Worker(engine), tok, "tiny", max_body_bytes=64 << 10, body_timeout_s=1.0)
        self.server = uvicorn.Server(
            uvicorn.Config(
                app,
                host="127.0.0.1",
                port=self.port,
                log_level="critical",
                http="h11",  # as compress.serve runs it
                h11_max_incomplete_event_size=H11_MAX_HEADER_BYTES,
            )
        )
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the server did not start")
            time.sleep(0.05)
        self.url = f"http://127.0.0.1:{self.port}"

    def close(self):
        self.server.should_exit = True
        self.thread.join(10)


def raw_request(port: int, data: bytes, timeout: float = 5.0) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        chunks = []
        try:
            s.sendall(data)
            while chunk := s.recv(65536):
                chunks.append(chunk)
        except (TimeoutError, ConnectionResetError):
            pass
        return b"".join(chunks)


def http_cases(fx: Fixtures, srv_holder: dict) -> list[Case]:
    import httpx

    def server():
        if "srv" not in srv_holder:
            srv_holder["srv"] = Server(fx.run)
        return srv_holder["srv"]

    def judge(status, r_status, text, url):
        try:
            err = json.loads(text)["error"]
            good_body = isinstance(err.get("message"), str) and err["message"] and "type" in err
        except (ValueError, KeyError, TypeError, AttributeError):
            good_body = False
        healthy = httpx.get(url + "/health", timeout=10).status_code == 200
        ok = r_status == status and good_body and healthy and "Traceback" not in text
        return (
            ok,
            f"HTTP {r_status} (want {status}){'' if healthy else ', server down'}: {text[:200]}",
        )

    def case(
        name,
        path,
        body=None,
        status=400,
        headers=None,
        raw=None,
        quick=False,
        method="post",
        stream=False,
    ):
        def go():
            s = server()
            if stream:
                with httpx.stream("POST", s.url + path, json=body, timeout=10) as r:
                    text = r.read().decode()
                    return judge(status, r.status_code, text, s.url)
            kw = {"timeout": 10}
            if raw is not None:
                kw["content"] = raw
            elif body is not None:
                kw["json"] = body
            if headers:
                kw["headers"] = headers
            r = getattr(httpx, method)(s.url + path, **kw)
            return judge(status, r.status_code, r.text, s.url)

        return Case("http", name, go, quick)

    def lie_case():
        s = server()
        body = b'{"model": "tiny", "prompt": "hi"}'
        t = time.monotonic()
        head = (
            f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body) + 100}\r\n\r\n"
        ).encode()
        reply = raw_request(s.port, head + body, timeout=10)
        took = time.monotonic() - t
        status = reply.split(b" ", 2)[1] if reply.startswith(b"HTTP/") else b"none"
        ok = status == b"408" and took < 5 and b'"error"' in reply
        return ok, f"status {status.decode()} after {took:.1f} s"

    def huge_header_case():
        s = server()
        head = (
            "POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Big: " + "a" * (256 << 10) + "\r\n"
            "Content-Type: application/json\r\nContent-Length: 2\r\n\r\n{}"
        ).encode()
        reply = raw_request(s.port, head, timeout=10)
        status = reply.split(b" ", 2)[1] if reply.startswith(b"HTTP/") else b"reset"
        return status in (b"400", b"431", b"reset"), f"status {status.decode()}"

    def chunked_case():
        s = server()

        def gen():
            for _ in range(40):
                yield b" " * 4096

        r = httpx.post(
            s.url + "/v1/completions",
            content=gen(),
            headers={"content-type": "application/json"},
            timeout=10,
        )
        return judge(413, r.status_code, r.text, s.url)

    c = {"model": "tiny", "prompt": "the quick"}
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}
    big = json.dumps(dict(c, prompt="fox " * (40 << 10))).encode()
    return [
        case("seed 2**64", "/v1/completions", dict(c, seed=2**64), quick=True),
        case(
            "seed 2**64, stream",
            "/v1/completions",
            dict(c, seed=2**64, stream=True),
            stream=True,
            quick=True,
        ),
        case("seed 2**70 (chat)", "/v1/chat/completions", dict(chat, seed=2**70)),
        case("seed -1", "/v1/completions", dict(c, seed=-1)),
        case("temperature -1", "/v1/completions", dict(c, temperature=-1)),
        case("temperature 3", "/v1/completions", dict(c, temperature=3)),
        case(
            "temperature NaN (raw JSON)",
            "/v1/completions",
            raw=b'{"model":"tiny","prompt":"hi","temperature":NaN}',
            headers={"content-type": "application/json"},
        ),
        case(
            "temperature Infinity (raw JSON)",
            "/v1/completions",
            raw=b'{"model":"tiny","prompt":"hi","temperature":Infinity}',
            headers={"content-type": "application/json"},
        ),
        case("temperature 'hot'", "/v1/completions", dict(c, temperature="hot")),
        case("top_p 0", "/v1/completions", dict(c, top_p=0)),
        case("top_p 1.5", "/v1/completions", dict(c, top_p=1.5)),
        case("top_k 0", "/v1/completions", dict(c, top_k=0)),
        case("top_k -2", "/v1/completions", dict(c, top_k=-2)),
        case("max_tokens 0", "/v1/completions", dict(c, max_tokens=0)),
        case("max_tokens -5", "/v1/completions", dict(c, max_tokens=-5)),
        case("max_tokens 2**70", "/v1/completions", dict(c, max_tokens=2**70)),
        case(
            "max_completion_tokens 0", "/v1/chat/completions", dict(chat, max_completion_tokens=0)
        ),
        case(
            "body over the limit (Content-Length)",
            "/v1/completions",
            raw=big,
            headers={"content-type": "application/json"},
            status=413,
            quick=True,
        ),
        case("Content-Length longer than the body", None)
        if False
        else Case("http", "Content-Length longer than the body", lie_case, True),
        Case("http", "chunked body over the limit", chunked_case),
        Case("http", "256 KiB header", huge_header_case),
        case(
            "content-type text/plain",
            "/v1/completions",
            raw=json.dumps(c).encode(),
            headers={"content-type": "text/plain"},
            quick=True,
        ),
        case(
            "content-type form-urlencoded",
            "/v1/completions",
            raw=json.dumps(c).encode(),
            headers={"content-type": "application/x-www-form-urlencoded"},
        ),
        case(
            "invalid JSON",
            "/v1/completions",
            raw=b'{"model": ',
            headers={"content-type": "application/json"},
        ),
        case(
            "JSON array body",
            "/v1/completions",
            raw=b"[1, 2]",
            headers={"content-type": "application/json"},
        ),
        case(
            "empty body", "/v1/completions", raw=b"", headers={"content-type": "application/json"}
        ),
        case("prompt a number", "/v1/completions", dict(c, prompt=5)),
        case("prompt a list of lists", "/v1/completions", dict(c, prompt=[[1, 2]])),
        case("prompt token outside the vocabulary", "/v1/completions", dict(c, prompt=[5, 10**6])),
        case("prompt negative token", "/v1/completions", dict(c, prompt=[-1])),
        case("prompt empty string", "/v1/completions", dict(c, prompt="")),
        case("prompt empty list", "/v1/completions", dict(c, prompt=[])),
        case("two prompts", "/v1/completions", dict(c, prompt=["a", "b"])),
        case("model missing", "/v1/completions", {"prompt": "hi"}),
        case("unknown model", "/v1/completions", dict(c, model="gpt-9"), status=404),
        case("messages empty", "/v1/chat/completions", dict(chat, messages=[])),
        case(
            "message role wizard",
            "/v1/chat/completions",
            dict(chat, messages=[{"role": "wizard", "content": "hi"}]),
        ),
        case(
            "image content part",
            "/v1/chat/completions",
            dict(
                chat,
                messages=[
                    {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}
                ],
            ),
        ),
        case("max_tokens -1 (chat)", "/v1/chat/completions", dict(chat, max_tokens=-1)),
        case("five stop strings", "/v1/completions", dict(c, stop=list("abcde"))),
        case("empty stop string", "/v1/completions", dict(c, stop=[""])),
        case("n 2", "/v1/completions", dict(c, n=2)),
        case("echo true", "/v1/completions", dict(c, echo=True)),
        case("logprobs 5", "/v1/completions", dict(c, logprobs=5)),
        case("presence_penalty 1", "/v1/completions", dict(c, presence_penalty=1)),
        case("prompt + max_tokens over the context", "/v1/completions", dict(c, max_tokens=500)),
        case(
            "over-long prompt, stream",
            "/v1/completions",
            dict(c, prompt="fox " * 300, stream=True),
            stream=True,
        ),
        case("GET /v1/completions", "/v1/completions", method="get", status=405),
        case("unknown route", "/v1/nothing", method="get", status=404),
        case("stream_options not an object", "/v1/completions", dict(c, stream_options=5)),
    ]


def pipeline_cases(fx: Fixtures) -> list[Case]:
    from compress.__main__ import main

    def case(name, args, recipe="rtn_int4", quick=False):
        out = fx.root / "runs" / re.sub(r"[^A-Za-z0-9_.-]", "_", name)

        def go():
            given = [a for a in args if a.startswith("hydra.run.dir=")]
            leftover = Path(given[0].split("=", 1)[1]) if given else out
            existed = leftover.exists()
            argv = [f"recipe={recipe}"] + args + ([] if given else [f"hydra.run.dir={out}"])
            old = sys.argv
            sys.argv = ["compress"] + argv
            try:
                res = capture(main)
            finally:
                sys.argv = old
            return judge_cli(*res, leftover=None if existed else leftover)

        return Case("pipeline", name, go, quick)

    hf = f"model.path={fx.hf}"
    return [
        case("hydra.run.dir=/proc/x", [hf, "hydra.run.dir=/proc/x"], quick=True),
        case("hydra.run.dir under a file", [hf, f"hydra.run.dir={fx.afile}/sub"], quick=True),
        case("hydra.run.dir is a file", [hf, f"hydra.run.dir={fx.afile}"]),
        case("hydra.run.dir not empty", [hf, f"hydra.run.dir={fx.hf}"]),
        case("model.path unknown model_type", [f"model.path={fx.cfg_unknown}"], quick=True),
        case("model.path config.json not JSON", [f"model.path={fx.cfg_invalid}"]),
        case("model.path config.json a list", [f"model.path={fx.cfg_list}"]),
        case("model.path config.json not UTF-8", [f"model.path={fx.cfg_binary}"]),
        case("model.path without model_type", [f"model.path={fx.cfg_notype}"]),
        case("model.path field of the wrong kind", [f"model.path={fx.cfg_field}"]),
        case("model.path gpt2", [f"model.path={fx.cfg_gpt2}"]),
        case("model.path does not exist", [f"model.path={fx.root / 'nope'}"]),
        case("model.path a file", [f"model.path={fx.afile}"]),
        case("model.path quantized run folder", [f"model.path={fx.run}"]),
        case(
            "model.path damaged run folder (manifest)", [f"model.path={fx.fp_damaged}"], quick=True
        ),
        case("model.path no tokenizer", [f"model.path={fx.no_tokenizer}"]),
        case("data.eval.source empty file", [hf, f"data.eval.source={fx.empty_txt}"], quick=True),
        case("data.eval.source whitespace only", [hf, f"data.eval.source={fx.blank_txt}"]),
        case("data.eval.source not UTF-8", [hf, f"data.eval.source={fx.binary_txt}"]),
        case("data.eval.source a folder", [hf, f"data.eval.source={fx.root}"]),
        case("data.eval.source missing", [hf, f"data.eval.source={fx.root / 'none.txt'}"]),
        case(
            "eval.windows more than the text holds",
            [hf, f"data.eval.source={fx.short_txt}", "eval.seqlen=16", "eval.windows=50"],
        ),
        case(
            "eval.seqlen longer than the text",
            [hf, f"data.eval.source={fx.short_txt}", "eval.seqlen=4096"],
        ),
        case(
            "awq: data.calib.source empty",
            [hf, f"data.calib.source={fx.empty_txt}"],
            recipe="awq_int4",
        ),
        case(
            "awq: calibration too short",
            [hf, f"data.calib.source={fx.short_txt}", "calib.samples=64", "calib.seqlen=64"],
            recipe="awq_int4",
            quick=True,
        ),
        case("rtn.bits=9", [hf, "rtn.bits=9"]),
        case("rtn.group_size=48", [hf, "rtn.group_size=48"]),
        case("eval.windows=0", [hf, "eval.windows=0"]),
        case("eval.seqlen=-1", [hf, "eval.seqlen=-1"]),
        case("eval.device=tpu", [hf, "eval.device=tpu"]),
        case("unknown key", [hf, "rtn.bitz=4"]),
        case("unknown recipe", [hf], recipe="nope"),
        case("model.dtype=int8", [hf, "model.dtype=int8"]),
        case("decode.kv=bogus", [hf, "decode.kv=bogus"]),
        case("decode.threads=0", [hf, "decode.threads=0"]),
        case("override syntax error", [hf, "eval.windows=[1,"]),
    ]


def api_cases(fx: Fixtures) -> list[Case]:
    import compress
    from compress.decoder.sampling import Sampling
    from compress.errors import CompressError
    from compress.testing import random_model, tiny_config

    def judge(fn):
        try:
            with (
                contextlib.redirect_stdout(io.StringIO()),
                contextlib.redirect_stderr(io.StringIO()),
            ):
                fn()
        except CompressError as e:
            return one_paragraph(str(e)), str(e)[:160]
        except BaseException as e:  # noqa: BLE001
            return False, f"{type(e).__name__}: {str(e)[:200]}"
        return False, "no error"

    def case(name, fn, quick=False, leftover=None):
        def go():
            ok, detail = judge(fn)
            if leftover is not None and Path(leftover).exists():
                return False, f"left {leftover} behind"
            return ok, detail

        return Case("api", name, go, quick)

    model = lambda: random_model(tiny_config())
    out = fx.root / "api"
    out.mkdir(exist_ok=True)
    full = out / "full"
    full.mkdir()
    (full / "x").write_text("x")
    rtn = compress.RTNConfig(bits=4, group_size=64)
    return [
        case(
            "quantize(nn.Linear(64, 64), RTNConfig)",
            lambda: compress.quantize(torch.nn.Linear(64, 64), rtn),
            quick=True,
        ),
        case("quantize(None, RTNConfig)", lambda: compress.quantize(None, rtn)),
        case("quantize(model, 'rtn')", lambda: compress.quantize(model(), "rtn")),
        case(
            "quantize(model, RTNConfig(bits=9))",
            lambda: compress.quantize(model(), compress.RTNConfig(bits=9)),
        ),
        case(
            "quantize(model, RTNConfig(group_size=48))",
            lambda: compress.quantize(model(), compress.RTNConfig(group_size=48)),
        ),
        case(
            "quantize(model, AWQConfig()) without tokenizer",
            lambda: compress.quantize(model(), compress.AWQConfig()),
        ),
        case(
            "quantize an already quantized model",
            lambda: compress.quantize(
                compress.quantize(model(), compress.RTNConfig(group_size=16)), rtn
            ),
        ),
        case(
            "save(nn.Linear, folder)",
            lambda: compress.save(torch.nn.Linear(64, 64), out / "lin"),
            quick=True,
            leftover=out / "lin",
        ),
        case("save(model, a file)", lambda: compress.save(model(), fx.afile), quick=True),
        case(
            "save(model, under a file)",
            lambda: compress.save(model(), fx.afile / "sub"),
            leftover=None,
        ),
        case("save(model, /proc/x)", lambda: compress.save(model(), "/proc/x")),
        case("save(model, a folder with files)", lambda: compress.save(model(), full)),
        case(
            "save(model, folder, tokenizer='tok')",
            lambda: compress.save(model(), out / "tokstr", tokenizer="tok"),
            leftover=out / "tokstr",
        ),
        case("save(model, None)", lambda: compress.save(model(), None)),
        case("run('nope')", lambda: compress.run("nope")),
        case("run(123)", lambda: compress.run(123)),
        case("run(recipe, 5)", lambda: compress.run("rtn_int4", 5)),
        case(
            "run with unknown model_type",
            lambda: compress.run("rtn_int4", model=fx.cfg_unknown, out=out / "r1"),
            leftover=out / "r1",
        ),
        case("run into /proc/x", lambda: compress.run("rtn_int4", model=fx.hf, out="/proc/x")),
        case(
            "run with an empty eval text",
            lambda: compress.run(
                "rtn_int4",
                model=fx.hf,
                out=out / "r2",
                data={"eval": {"source": str(fx.empty_txt)}},
            ),
            quick=True,
            leftover=out / "r2",
        ),
        case(
            "run on a damaged run folder",
            lambda: compress.run("fp", model=fx.fp_damaged, out=out / "r3"),
            quick=True,
            leftover=out / "r3",
        ),
        case(
            "run with eval={'windows': -1}",
            lambda: compress.run("rtn_int4", model=fx.hf, out=out / "r4", eval={"windows": -1}),
            leftover=out / "r4",
        ),
        case(
            "run with an unknown setting",
            lambda: compress.run(
                "rtn_int4", model=fx.hf, out=out / "r5", evaluation={"windows": 1}
            ),
            leftover=out / "r5",
        ),
        case(
            "quantize(AWQ) with 1-D calibration ids",
            lambda: compress.quantize(
                model(),
                compress.AWQConfig(group_size=16),
                tokenizer=fx.tok,
                calibration=torch.zeros(8, dtype=torch.long),
            ),
        ),
        case(
            "quantize(AWQ) with float calibration",
            lambda: compress.quantize(
                model(),
                compress.AWQConfig(group_size=16),
                tokenizer=fx.tok,
                calibration=torch.rand(2, 16),
            ),
        ),
        case(
            "quantize(AWQ) with ids outside the vocabulary",
            lambda: compress.quantize(
                model(),
                compress.AWQConfig(group_size=16),
                tokenizer=fx.tok,
                calibration=torch.full((2, 16), 10**6),
            ),
        ),
        case(
            "quantize(AWQ) with an empty calibration file",
            lambda: compress.quantize(
                model(),
                compress.AWQConfig(group_size=16),
                tokenizer=fx.tok,
                calibration=str(fx.empty_txt),
            ),
        ),
        case(
            "quantize(AWQ) with a calibration file too short",
            lambda: compress.quantize(
                model(),
                compress.AWQConfig(group_size=16),
                tokenizer=fx.tok,
                calibration=str(fx.short_txt),
            ),
        ),
        case("Sampling(temperature=-1)", lambda: Sampling(temperature=-1)),
        case("Sampling(temperature=0.7, top_p=0)", lambda: Sampling(0.7, top_p=0)),
        case("Sampling(seed=2**70)", lambda: Sampling(seed=2**70), quick=True),
        case("Sampling(top_k=0)", lambda: Sampling(1.0, top_k=0)),
        case("Sampling(temperature='hot')", lambda: Sampling(temperature="hot")),
    ]


def all_cases(fx: Fixtures, srv: dict) -> list[Case]:
    return (
        pipeline_cases(fx)
        + decoder_cases(fx)
        + serve_cli_cases(fx)
        + http_cases(fx, srv)
        + api_cases(fx)
    )
