"""``python -m compress.serve RUN [--host 127.0.0.1 --port 8000]``: serve a run folder over HTTP.

OpenAI-compatible ``/v1/completions`` and ``/v1/chat/completions`` (streaming or not),
``/v1/models``, ``/health`` and ``/metrics``, from one engine (``compress.serve.engine``) that
batches every request in flight over a pool of ``--num-blocks`` KV blocks. Listens on
127.0.0.1 unless ``--host`` says otherwise.

Access: with ``--api-key KEY`` (or the environment variable ``COMPRESS_API_KEY``, which ``ps``
does not show) every route but ``/health`` needs ``Authorization: Bearer KEY``
(``compress.serve.auth``). Without a key the server listens only on a loopback address; a
``--host`` other machines can reach needs a key, or ``--allow-no-key`` to serve openly on
purpose. Connections that stall are closed: ``--idle-timeout`` before a request,
``--header-timeout`` for its head, ``--body-timeout`` for its body (``compress.serve.server``).
"""

import argparse
import logging
import os
import sys
from pathlib import Path

from compress.decoder.devices import check_device
from compress.decoder.model import load
from compress.decoder.runtime import RuntimeConfig, named_settings, resolve_runtime
from compress.decoder.sampling import check_sampling
from compress.errors import ArgumentParser, CompressError
from compress.io.manifest import skip_verification, verify_folder
from compress.kernels.w4a8_cpu import use
from compress.serve.auth import check_key
from compress.serve.engine import Engine, invariant_model
from compress.serve.limits import (
    BODY_TIMEOUT_S,
    H11_MAX_HEADER_BYTES,  # noqa: F401  (imported from here by tests and the sweep)
    HEAD_TIMEOUT_S,
    IDLE_TIMEOUT_S,
    MAX_BODY_BYTES,
)
from compress.serve.runahead import RunaheadPrefill
from compress.serve.worker import Worker

DTYPES = ("float32", "bfloat16", "float16")
KEY_ENV = "COMPRESS_API_KEY"


def parse_args(argv=None) -> argparse.Namespace:
    p = ArgumentParser(prog="python -m compress.serve", description=__doc__.splitlines()[0])
    p.add_argument("run", help="run folder (any recipe's) or HF Llama-family folder")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument(
        "--served-model-name", help="the model id clients send (default: the folder's name)"
    )
    p.add_argument("--num-blocks", type=int, default=1024, help="KV blocks in the pool")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    p.add_argument(
        "--local-blocks",
        type=int,
        help="KV blocks in each sliding-window layer group's pool (default: what --max-seqs "
        "windows and a step's tokens can hold at once, at most --num-blocks)",
    )
    p.add_argument("--max-seqs", type=int, default=32, help="sequences batched at once")
    p.add_argument(
        "--max-step-tokens",
        type=int,
        default=512,
        help="prompt tokens per step (longer prompts are prefilled in chunks)",
    )
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument(
        "--kv", choices=("fp16", "full"), default="fp16", help="KV storage; full: the compute dtype"
    )
    p.add_argument(
        "--dtype",
        choices=DTYPES,
        help="the model's dtype (default: bfloat16 for a group-quantized folder on the CPU, "
        "else float32; float32 keeps the exact path)",
    )
    p.add_argument("--qdtype", choices=DTYPES, help="dtype the int-quantized layers compute in")
    p.add_argument(
        "--kernel",
        choices=("exact", "w4a8"),
        help="how the quantized layers compute: exact (weight-only) or w4a8 (int8 activations, "
        "integer dot products; CPU; the default for a group-quantized folder on the CPU)",
    )
    p.add_argument(
        "--head",
        choices=("none", "int8", "int4"),
        help="quantize the output head at load (default: the folder's recorded quant.lm_head; "
        "with --batch-invariant: int8 when the folder records none)",
    )
    p.add_argument(
        "--batch-invariant",
        action=argparse.BooleanOptionalAction,
        help="a request's output does not depend on what else is served: W4A8 linears at every "
        "M (lean), the head quantized, attention query by query in a fixed order (CPU). Default: "
        "on for a group-quantized folder on the CPU unless a named setting rules it out "
        "(--dtype float32, --kernel exact, --head none, --prefill-ranks > 1), else off",
    )
    p.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    p.add_argument("--threads", type=int, help="CPU threads for torch")
    p.add_argument(
        "--prefill-ranks",
        type=int,
        default=1,
        help="KV-Runahead: prefill long prompts over this many processes (gloo), this one the last",
    )
    p.add_argument(
        "--runahead-min-tokens",
        type=int,
        default=256,
        help="prompts this long or longer go to the prefill ranks",
    )
    p.add_argument("--log-level", default="info")
    p.add_argument(
        "--max-body-bytes",
        type=int,
        default=MAX_BODY_BYTES,
        help=f"larger request bodies get 413 (default {MAX_BODY_BYTES >> 20} MiB)",
    )
    p.add_argument(
        "--body-timeout",
        type=float,
        default=BODY_TIMEOUT_S,
        help=f"seconds a request body may take to arrive whole, else 408 (default {BODY_TIMEOUT_S:g})",
    )
    p.add_argument(
        "--header-timeout",
        type=float,
        default=HEAD_TIMEOUT_S,
        help="seconds a request's line and headers may take to arrive whole, counted from when "
        f"the connection is ready for it, else it is closed (default {HEAD_TIMEOUT_S:g})",
    )
    p.add_argument(
        "--idle-timeout",
        type=float,
        default=IDLE_TIMEOUT_S,
        help="seconds a connection may stay silent before a request (a new one, or kept alive "
        f"after a response), else it is closed (default {IDLE_TIMEOUT_S:g})",
    )
    p.add_argument(
        "--api-key",
        help=f"require 'Authorization: Bearer KEY' on every route but /health (default: the "
        f"environment variable {KEY_ENV}, which other users cannot read from the process list)",
    )
    p.add_argument(
        "--allow-no-key",
        action="store_true",
        help="serve without a key on a --host other machines can reach (refused otherwise)",
    )
    p.add_argument(
        "--no-verify",
        action="store_true",
        help="skip checking the folder's files against the sha256 its manifest.json records "
        "(for a folder edited on purpose)",
    )
    return p.parse_args(argv)


LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")


def check_arguments(args) -> None:
    """Everything the server can check before the model loads: the numbers, the device, and
    that the address can be listened on (a port in use or out of range would fail only after
    the load, with an asyncio traceback)."""

    for flag in (
        "num_blocks",
        "block_size",
        "max_seqs",
        "max_step_tokens",
        "prefill_ranks",
        "runahead_min_tokens",
        "max_body_bytes",
        "local_blocks",
    ):
        value = getattr(args, flag)
        if value is not None and value < 1:
            raise CompressError(f"--{flag.replace('_', '-')} {value}: give an integer >= 1.")
    for flag in ("body_timeout", "header_timeout", "idle_timeout"):
        value = getattr(args, flag)
        if not 0 < value < float("inf"):
            raise CompressError(
                f"--{flag.replace('_', '-')} {value}: give a number of seconds > 0."
            )
    check_sampling(threads=args.threads, names={"threads": "--threads"})
    if args.log_level.lower() not in LOG_LEVELS:
        raise CompressError(f"--log-level {args.log_level}: use one of {', '.join(LOG_LEVELS)}.")
    if args.device is not None:
        args.device = check_device(args.device)
    check_access(args)
    check_listen(args.host, args.port)


def check_access(args) -> None:
    """Settle ``args.api_key`` (``--api-key``, else ``COMPRESS_API_KEY``, else None) and refuse
    to serve without one on an address other machines can reach, unless ``--allow-no-key``."""

    if args.api_key is not None:
        check_key(args.api_key)
    elif os.environ.get(KEY_ENV):
        args.api_key = os.environ[KEY_ENV]
        check_key(args.api_key, KEY_ENV)
    if args.api_key is None and not args.allow_no_key and not loopback(args.host):
        raise CompressError(
            f"--host {args.host} can be reached from other machines, and no API key is set: "
            f"anyone who can reach the port could use the model. Give --api-key KEY (or set "
            f"{KEY_ENV}; clients then send 'Authorization: Bearer KEY', the openai client "
            f"api_key=KEY), or --allow-no-key to serve without one on purpose, or --host "
            f"127.0.0.1 to serve this machine only."
        )


def loopback(host: str) -> bool:
    """Whether every address ``host`` resolves to is a loopback address (127.0.0.0/8, ::1);
    an unresolvable host counts as loopback here (``check_listen`` refuses it)."""
    import ipaddress
    import socket

    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError):
        return True
    return all(ipaddress.ip_address(info[4][0].split("%")[0]).is_loopback for info in infos)


def check_listen(host: str, port: int) -> None:
    """Bind ``host:port`` once and let it go, as uvicorn will bind it."""
    import socket

    if not 0 <= port <= 65535:
        raise CompressError(
            f"--port {port}: a TCP port is a number from 1 to 65535 (0: any free port)."
        )
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as e:
        raise CompressError(
            f"--host {host}: this machine cannot resolve that address ({e}); use 127.0.0.1 "
            f"(this machine only) or 0.0.0.0 (every interface)."
        ) from None
    family, kind, proto, _, addr = infos[0]
    with socket.socket(family, kind, proto) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
        try:
            s.bind(addr)
        except OSError as e:
            raise CompressError(
                f"cannot listen on {host}:{port} ({e.strerror}): "
                + (
                    "another process is using that port; stop it or pick another --port."
                    if e.errno == 98
                    else "pick another --port or --host (ports below 1024 need root)."
                )
            ) from None


def resolve_configuration(args, device: str) -> RuntimeConfig:
    """The server's configuration (``compress.decoder.runtime.resolve_runtime``, serving): on a
    group-quantized folder on the CPU, batch-invariant in bfloat16 (W4A8 at every M, the int8
    head, fixed-order attention) for the settings not named, so a request's output does not
    depend on what else is served; ``--dtype float32`` keeps the exact path, and KV-Runahead
    (``--prefill-ranks`` > 1) is not batch-invariant. ``args`` gets the resolved dtype, qdtype,
    kernel and batch_invariant."""
    named = named_settings(args)
    if args.prefill_ranks > 1 and named["batch_invariant"] is None:
        named["batch_invariant"] = False
    conf = resolve_runtime(args.run, device, named, serving=True)
    args.dtype, args.qdtype, args.kernel = conf.dtype, conf.qdtype, conf.kernel
    args.batch_invariant = conf.batch_invariant
    return conf


def main(argv=None) -> None:
    args = parse_args(argv)
    try:
        if not Path(args.run).exists():
            raise CompressError(
                f"run folder '{args.run}' does not exist. Pass a folder a recipe "
                f"wrote (outputs/...) or an HF Llama-family folder."
            )
        require_serve_extra()
        check_arguments(args)
        if args.no_verify:  # the loader checks again unless told
            skip_verification(args.run)
        else:
            verify_folder(args.run)
        serve(args)
    except CompressError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


def require_serve_extra() -> None:
    """The HTTP stack is the ``serve`` extra: refused before the model loads without it."""
    import importlib.util

    missing = [m for m in ("fastapi", "uvicorn") if importlib.util.find_spec(m) is None]
    if missing:
        raise CompressError(
            f"the server needs {' and '.join(missing)}, which are not installed: "
            "pip install 'compress[serve]' (the README's install command has them)."
        )


def load_model(args, device: str):
    """The model and tokenizer ``args`` describe, in the configuration
    ``resolve_configuration`` settles (logged to stderr before it loads)."""
    conf = resolve_configuration(args, device)
    log = logging.getLogger("compress.serve")
    log.info("configuration: %s", conf.describe())
    model, tok = load(args.run, runtime=conf)
    if conf.batch_invariant:
        use(model, "w4a8", every_m=True)  # the integer kernel for every step, prefills too
        if conf.fast and not invariant_model(model):  # e.g. no C++ compiler: warned
            args.batch_invariant = False
            log.warning("batch invariance is off: not every linear computes through W4A8")
    if tok is None:
        raise CompressError(
            f"'{args.run}' has no tokenizer files; the server needs one to read text."
        )
    return model, tok


def serve(args) -> None:
    import torch

    from compress.serve.app import create_app  # heavy: FastAPI (the serve extra)
    from compress.serve.server import make_server  # heavy: uvicorn (the serve extra)

    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s"
    )
    if args.threads:
        torch.set_num_threads(args.threads)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    model, tok = load_model(args, device)
    runahead = None
    if args.prefill_ranks > 1:
        runahead = RunaheadPrefill(
            model, args.run, args.prefill_ranks, args.dtype, args.qdtype, threads=args.threads or 1
        )
    try:
        engine = Engine(
            model,
            tok,
            num_blocks=args.num_blocks,
            block_size=args.block_size,
            max_seqs=args.max_seqs,
            max_step_tokens=args.max_step_tokens,
            kv=args.kv,
            prefix_caching=not args.no_prefix_caching,
            runahead=runahead,
            runahead_min_tokens=args.runahead_min_tokens,
            batch_invariant=args.batch_invariant,
            local_blocks=args.local_blocks,
        )
        name = args.served_model_name or Path(args.run).resolve().name
        app = create_app(
            Worker(engine),
            tok,
            name,
            max_body_bytes=args.max_body_bytes,
            body_timeout_s=args.body_timeout,
            api_key=args.api_key,
        )
        log = logging.getLogger("compress.serve")
        if args.api_key is None and not loopback(args.host):
            log.warning("serving without an API key on %s (--allow-no-key)", args.host)

        def listening(host: str, port: int) -> None:  # the bound port, also for --port 0
            log.info(
                "serving '%s' on http://%s:%d (%d KV blocks of %d tokens; %s)",
                name,
                f"[{host}]" if ":" in host else host,
                port,
                args.num_blocks,
                args.block_size,
                "API key required" if args.api_key else "no API key",
            )

        server = make_server(
            app,
            host=args.host,
            port=args.port,
            log_level=args.log_level.lower(),
            head_timeout=args.header_timeout,
            body_timeout=args.body_timeout,
            idle_timeout=args.idle_timeout,
            on_listening=listening,
        )
        try:
            server.run()
        except KeyboardInterrupt:  # Ctrl-C: uvicorn shut down gracefully, then re-raised it
            return
        if not server.started:  # uvicorn logged why (an address taken since the check)
            sys.exit(3)
    finally:
        if runahead is not None:
            runahead.close()


if __name__ == "__main__":
    main()
