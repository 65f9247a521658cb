"""Batch-1 decode and prefill speed, and peak memory, side by side in one run.

    python eval/bench/bench_decode.py --int4 outputs/awq_int4 [--int3 outputs/awq_int3]
        [--fp FOLDER] [--rounds 5] [--new 128] [--prompt-len 32] [--prefill-len 512]
        [--threads 1 2] [--json OUT]

Systems (``--systems`` picks some):

    ours-int4       compress.decoder on the int4 run folder (fp32 activations, fp16 KV cache)
    ours-int4-q16   the same, the int4 layers computing in bfloat16 (``--qdtype bfloat16``: ATen's
                    int4pack kernel; inputs rounded to bfloat16, so not bit-faithful to the run folder)
    ours-int4-bf16  the same with everything in bfloat16 (embedding and head included)
    ...-lean        the same, loaded ``lean``: only the int4pack form of each layer is kept
    ...-head8/4     the same, the output head group-quantized at load (``--head int8/int4``)
    ...-w4a8        the same, the quantized layers through the W4A8 kernel (``--kernel w4a8``:
                    int8 activations, integer dot products; ``compress.kernels.w4a8_cpu``)
    ours-int4-default  the decoder's default configuration for the folder (``python -m
                    compress.decoder RUN``: bfloat16, lean, its kernel and head, compiled)
    ours-int3-...   the same rows on the ``--int3`` folder (e.g. awq_int3)
    ...+compile     the same system decoding with the static-shape compiled step
                    (``compress.decoder.compiled``; compiled in the warm-up round)
    ours-fp32       compress.decoder on the fp32 model (default: the default model's folder)
    ours-bf16       the same, weights and activations in bfloat16
    hf-fp32         transformers ``generate`` on the same fp32 model (eager, its dynamic cache)
    llama.cpp       llama-cpp-python on the embedded model's own GGUF (``--model``: the default
                    model's Q4_1, or Gemma 3 270M's Q4_K_M), or on ``--gguf``, n_threads =
                    --threads (2)
    NAME[KV]        compress.decoder (fp32, eager) on ``--folders NAME=PATH`` with each ``--kvs`` cache:
                    any run folder, attention-converted ones too, beside the default model's.
                    KV is a cache kind with options, ``kivi:bits=4`` (``compress.decoder.kv``)
    NAME[KV]@N      the same after an N-token prompt, for each N of ``--contexts``

The context-length axis (the compressed caches against fp16 as the history grows)::

    python eval/bench/bench_decode.py --contexts 512 2048 8000 [--kvs fp16 kivi:bits=4 packkv]
        [--folders NAME=PATH] [--rounds 2] [--new 64] [--json OUT]

runs the default model (or each ``--folders`` folder) with each cache after prompts of N tokens
of WikiText-2 test (real text: ``COMPRESS_DATA_DIR`` must hold ``wikitext-2/``), one context at a
time (its workers only, so the machine holds one context's processes). Its table gives decode
tok/s and the ratio to the fp16 cache at the same context, the decode loop's peak RSS (the
mark is reset after each round's prefill, whose transient N x N scores would otherwise hide the
cache), the cache's MiB, and the prefill tok/s of that round's N-token prompt (a compressed cache
compresses the prompt there: ``cache.settle()``). No separate prefill phase runs for these rows.

Each system runs in two worker processes, one timing decode and then one timing prefill,
so that each has its own peak RSS (prefill's larger activations and kernels do not count
as decoding memory) and a llama.cpp crash (SIGILL from AMX on some VMs) cannot take the
script down. In each phase the rounds alternate between the systems; round 0 is a warm-up
(and compiles), then each of ``--rounds`` rounds times one greedy generation of ``--new``
tokens after the same ``--prompt-len``-token WikiText-2 prompt (EOS ignored), or one
prefill of ``--prefill-len`` tokens:

    decode tok/s  = (new - 1) / (time from the first generated token to the last)
    prefill tok/s = prefill_len / (time of the prefill forward)

Every system times itself the same way, in Python around its own calls (llama.cpp: around
``Llama.eval`` and ``Llama.sample``; transformers: a streamer's timestamps). The table gives
medians. Peak memory is the decode worker's peak RSS over the timed rounds (reset after
the warm-up, so loading does not count). "In memory" is the tensors the model holds,
kernel-prepared forms included; "on disk" the weight files, which the memory ratio uses.
Wall-clock figures on a shared machine are noisy: compare rows of one run, not runs.

``--threads 1 2`` runs everything once per thread count (torch's threads and llama.cpp's), one
table each. Before them the driver measures the memory bandwidth with a STREAM-like copy
(:func:`copy_bandwidth`: ``b.copy_(a)`` of 256 MiB, bytes read + written per second, best of
5) with each thread count, and each row gives the weight bytes a decode step reads (``read
MiB/token``: the tensors the model holds, less an embedding that the head does not share, which
a step reads one row of; for llama.cpp the GGUF's tensors, less ``token_embd`` when it has an
``output`` tensor; a mixture of experts' experts count top-k / experts of their bytes, the routed
ones a batch-1 step reads) and ``decode tok/s x read bytes / bandwidth``: how close the system runs
to the memory limit (1.0 = every weight byte once per token at the copy's bandwidth).
"""

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from compress.io.source import DEFAULT_MODEL

OURS = (
    "ours-int4",
    "ours-int4-q16",
    "ours-int4-bf16",
    "ours-int4-bf16-lean",
    "ours-fp32",
    "ours-bf16",
)
HEADS = ("ours-int4-bf16-lean-head8", "ours-int4-bf16-lean-head4")  # the head quantized at load
W4A8 = tuple(  # the quantized layers through the W4A8 kernel (int4, and the int3 folder)
    f"ours-{w}-bf16-lean-w4a8{h}" for w in ("int4", "int3") for h in ("", "-head8", "-head4")
)
SYSTEMS = (
    *OURS,
    *HEADS,
    *W4A8,
    *(f"{s}+compile" for s in (*OURS, *HEADS, *W4A8)),
    "ours-int4-default",
    "hf-fp32",
    "llama.cpp",
)
COPY_MIB = 256  # the bandwidth probe's buffer


def copy_bandwidth(threads: int, mib: int = COPY_MIB, repeat: int = 5) -> float:
    """Bytes per second of a STREAM-like copy (``b.copy_(a)``, ``mib`` MiB, read + written) on
    ``threads`` torch threads, best of ``repeat``."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        a = torch.ones(mib * 2**18)  # fp32: mib MiB
        b = torch.empty_like(a)
        b.copy_(a)  # first touch
        best = float("inf")
        for _ in range(repeat):
            t = time.perf_counter()
            b.copy_(a)
            best = min(best, time.perf_counter() - t)
        return 2 * a.numel() * 4 / best
    finally:
        torch.set_num_threads(before)


def gguf_read_bytes(path) -> int:
    """Bytes of a GGUF's tensors a decode step reads: all, less ``token_embd`` (one row read)
    when the file has a separate ``output`` head."""
    from gguf import GGUFReader

    reader = GGUFReader(str(path))
    sizes = {t.name: int(t.n_bytes) for t in reader.tensors}
    arch = bytes(reader.fields["general.architecture"].parts[-1]).decode()

    def field(key: str) -> int | None:
        f = reader.fields.get(f"{arch}.{key}")
        return int(f.parts[-1][0]) if f is not None else None

    used, count = field("expert_used_count"), field("expert_count")
    if used and count:  # a batch-1 step reads its routed experts only
        for name in [n for n in sizes if "_exps." in n]:
            sizes[name] = sizes[name] * used // count
    total = sum(sizes.values())
    return total - sizes.get("token_embd.weight", 0) if "output.weight" in sizes else total


def read_bytes(model) -> int:
    """Weight bytes a decode step of ``model`` reads (see the module docstring)."""
    total = model_bytes(model)
    moe = getattr(getattr(model, "spec", None), "moe", None)
    if moe is not None:  # a batch-1 step reads its top-k experts of each sparse layer
        experts = [
            m.experts for m in model.modules() if hasattr(m, "experts") and hasattr(m, "gate")
        ]
        held = sum(model_bytes(e) for e in experts)
        total -= held - held * moe.top_k // moe.n_experts
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    emb = emb if emb is not None else getattr(getattr(model, "model", None), "embed_tokens", None)
    head = getattr(model, "lm_head", None)
    if emb is None:
        return total
    shared = head is not None and any(
        t.untyped_storage().data_ptr() == emb.weight.untyped_storage().data_ptr()
        for t in [*head.parameters(), *head.buffers()]
    )
    return total if shared else total - emb.weight.untyped_storage().nbytes()


def tensor_bytes(objs) -> int:
    """Bytes of the distinct storages among tensors found in ``objs`` (nested lists/tuples/dicts)."""
    seen, total, stack = set(), 0, list(objs)
    while stack:
        o = stack.pop()
        if isinstance(o, torch.Tensor):
            key = (o.untyped_storage().data_ptr(), o.device)
            if key not in seen:
                seen.add(key)
                total += o.untyped_storage().nbytes()
        elif isinstance(o, dict):
            stack.extend(o.values())
        elif isinstance(o, (list, tuple)):
            stack.extend(o)
    return total


def model_bytes(model) -> int:
    """Parameters, buffers, and what the kernels prepared in ``layer.cache``."""
    caches = [m.cache for m in model.modules() if isinstance(getattr(m, "cache", None), dict)]
    return tensor_bytes([*model.parameters(), *model.buffers(), *caches])


def prompt_ids(tokenizer, n: int, offset: int = 0, real: bool = False) -> list[int]:
    """``n`` tokens of WikiText-2 test from token ``offset`` (a fixed sentence, repeated, without
    the data, unless ``real``: then the data must be there)."""
    from compress.errors import CompressError
    from compress.io.data import wikitext_file

    f = Path(os.environ.get("COMPRESS_DATA_DIR", ".")) / "wikitext-2" / "wiki.test.raw"
    if real:
        f = wikitext_file("wiki.test.raw")  # names the variable to set when it is unset
        if not f.is_file():
            raise CompressError(f"{f} not found: long-context prompts need WikiText-2 test.")
    text = (
        f.read_text()[: 50000 + 6 * (n + offset)]
        if f.is_file()
        else "The quick brown fox jumps over the lazy dog. " * (400 + n // 8)
    )
    ids = tokenizer(text).input_ids[offset : offset + n]
    if len(ids) != n:
        raise CompressError(f"the prompt text gave {len(ids)} tokens, not {n}.")
    return ids


def kv_spec(spec: str) -> tuple[str, dict]:
    """``"kivi:bits=4,group=32"`` -> ``("kivi", {"bits": 4, "group": 32})`` (values as JSON when
    they parse)."""
    from compress.decoder.kv import parse_options
    from compress.errors import CompressError

    kind, _, rest = spec.partition(":")
    try:
        opts = parse_options(list(filter(None, rest.split(","))), f"the cache '{spec}'")
    except CompressError as e:
        raise ValueError(str(e)) from None
    return kind, opts


# ---- workers: one system each, driven over stdin/stdout ----------------------------------------


class Ours:
    def __init__(
        self,
        folder,
        dtype,
        compile,
        qdtype=None,
        lean=False,
        kv="fp16",
        context=None,
        head="none",
        kernel="exact",
    ):
        from compress.decoder.model import load

        self.model, _ = load(
            folder,
            dtype=getattr(torch, dtype),
            qdtype=qdtype and getattr(torch, qdtype),
            lean=lean,
            head=head,
            kernel=kernel,
        )
        self.compile, (self.kv, self.kv_opts), self.context = compile, kv_spec(kv), context

    def decode(self, ids, new):
        from compress.decoder.generate import generate, peak_memory_reset
        from compress.decoder.model import release_freed_memory

        def decode_only():  # a long prompt's prefill peak is not decoding's
            release_freed_memory()
            peak_memory_reset()

        r = generate(
            self.model,
            [ids],
            new,
            compile=self.compile,
            ignore_eos=True,
            kv=self.kv,
            kv_opts=self.kv_opts,
            on_prefill=decode_only if self.context else None,
        )
        self.kv_bytes_per_token, self.kv_bytes = r.kv_bytes_per_token, r.kv_bytes
        self.prefill_tok_s = r.prefill_tok_s
        return r.decode_tok_s, r.tokens[0]

    def prefill(self, ids):
        from compress.decoder.generate import generate

        r = generate(self.model, [ids], 1, ignore_eos=True, kv=self.kv, kv_opts=self.kv_opts)
        return r.prefill_tok_s

    def weight_bytes(self):
        return model_bytes(self.model)

    def read_bytes(self):
        return read_bytes(self.model)


class HF:
    def __init__(self, folder):
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()

    def decode(self, ids, new):
        times = []

        class Clock:  # transformers' streamer protocol: put(prompt), put(token) per step, end()
            def put(self, value):
                times.append(time.perf_counter())

            def end(self):
                times.append(time.perf_counter())

        with torch.no_grad():
            out = self.model.generate(
                torch.tensor([ids]),
                max_new_tokens=new,
                do_sample=False,
                eos_token_id=[],
                pad_token_id=0,
                streamer=Clock(),
            )
        return (new - 1) / (times[-1] - times[1]), out[0, len(ids) :].tolist()

    def prefill(self, ids):
        with torch.no_grad():
            t = time.perf_counter()
            self.model(torch.tensor([ids]), use_cache=True, logits_to_keep=1)
            return len(ids) / (time.perf_counter() - t)

    def weight_bytes(self):
        return model_bytes(self.model)

    def read_bytes(self):
        return read_bytes(self.model)


class LlamaCpp:
    def __init__(self, gguf, threads):
        import llama_cpp
        from llama_cpp import llama as module

        default_params = module.llama_cpp.llama_model_default_params

        def params():  # AMX "extra buffer types" crash with SIGILL on some VMs
            p = default_params()
            p.use_extra_bufts = False
            return p

        module.llama_cpp.llama_model_default_params = params
        self.llm = llama_cpp.Llama(
            str(gguf),
            n_threads=threads,
            n_threads_batch=threads,
            n_ctx=1024,
            n_batch=512,
            verbose=False,
        )
        self.gguf = gguf

    def decode(self, ids, new):
        self.llm.reset()
        self.llm.eval(ids)
        out = [self.llm.sample(temp=0.0)]
        t = time.perf_counter()
        for _ in range(new - 1):
            self.llm.eval([out[-1]])
            out.append(self.llm.sample(temp=0.0))
        return (new - 1) / (time.perf_counter() - t), out

    def prefill(self, ids):
        self.llm.reset()
        t = time.perf_counter()
        self.llm.eval(ids)
        return len(ids) / (time.perf_counter() - t)

    def weight_bytes(self):
        return Path(self.gguf).stat().st_size  # mmapped file: weights as stored

    def read_bytes(self):
        return gguf_read_bytes(self.gguf)


FOLDER_SYSTEM = re.compile(r"^(?P<base>[^\[\]@]+)\[(?P<kv>[^\]]+)\](?:@(?P<context>\d+))?$")


def folder_system(name: str, args):
    """``(folder, kv, context or None)`` of a ``NAME[KV]`` or ``NAME[KV]@N`` system from
    ``--folders``, or None."""
    m = FOLDER_SYSTEM.match(name)
    if not m:
        return None
    context = m["context"] and int(m["context"])
    return dict(f.split("=", 1) for f in args.folders)[m["base"]], m["kv"], context


def make_system(name, args):
    if folder_system(name, args):
        folder, kv, context = folder_system(name, args)
        return Ours(folder, "float32", False, kv=kv, context=context)
    if name == "ours-int4-default":
        from compress.decoder.__main__ import configuration, parse_args

        c = configuration(parse_args([args.int4, "--prompt", "x", "--device", "cpu"])).as_dict()
        return Ours(args.int4, c["dtype"], c["compile"], c["qdtype"], c["lean"],
                    head=c["head"], kernel=c["kernel"])  # fmt: skip
    if name.startswith("ours-"):
        base, compiled = name.removesuffix("+compile"), name.endswith("+compile")
        head = {"-head8": "int8", "-head4": "int4"}.get(base[-6:], "none")
        base = base.removesuffix("-head8").removesuffix("-head4")
        base, kernel = base.removesuffix("-w4a8"), "w4a8" if base.endswith("-w4a8") else "exact"
        base, lean = base.removesuffix("-lean"), base.endswith("-lean")
        folder = {"ours-int4": args.int4, "ours-int3": args.int3}.get(name[:9], args.fp)
        return Ours(
            folder,
            "bfloat16" if base.endswith("bf16") else "float32",
            compiled,
            "bfloat16" if base.endswith("q16") else None,
            lean,
            head=head,
            kernel=kernel,
        )
    if name == "hf-fp32":
        return HF(args.fp)
    from compress.io.source import embedded_gguf

    return LlamaCpp(args.gguf or embedded_gguf(args.model), args.threads[0])


def worker(spec: str, args) -> None:
    """Load system ``spec = NAME:TASK`` (TASK decode | prefill), then answer each stdin line with one round."""
    from transformers import AutoTokenizer

    from compress.decoder.generate import peak_memory, peak_memory_reset
    from compress.decoder.model import release_freed_memory

    name, task = spec.rsplit(":", 1)
    torch.set_num_threads(args.threads[0])
    out, sys.stdout = sys.stdout, sys.stderr  # libraries' chatter goes to stderr
    tok = AutoTokenizer.from_pretrained(args.fp)
    context = (folder_system(name, args) or (None, None, None))[2]
    ids = (
        prompt_ids(tok, context or args.prompt_len, real=bool(context))
        if task == "decode"
        else prompt_ids(tok, args.prefill_len, args.prompt_len)
    )
    system = make_system(name, args)
    print(json.dumps({"ready": True}), file=out, flush=True)
    for i, _ in enumerate(sys.stdin):
        if task == "decode":
            tok_s, tokens = system.decode(ids, args.new)
        else:
            tok_s, tokens = system.prefill(ids), []
        if (
            i == 0
        ):  # after the warm-up: loading, first-use kernel preparation and compiling do not count
            release_freed_memory()
            peak_memory_reset()
        print(
            json.dumps(
                {
                    "tok_s": tok_s,
                    "peak_mem_bytes": peak_memory(),
                    "memory_bytes": system.weight_bytes(),
                    "read_bytes": system.read_bytes(),
                    "kv_bytes_per_token": getattr(system, "kv_bytes_per_token", None),
                    "kv_bytes": getattr(system, "kv_bytes", None),
                    "prompt_prefill_tok_s": getattr(system, "prefill_tok_s", None),
                    "text": tok.decode([t for t in tokens if t < len(tok)]),  # --gguf: any vocab
                }
            ),
            file=out,
            flush=True,
        )


# ---- the driver ---------------------------------------------------------------------------------


class Worker:
    def __init__(self, spec, argv):
        self.spec = spec
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "--worker", spec, *argv],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self.read()  # loaded

    def read(self):
        line = self.proc.stdout.readline()
        if not line:
            code = self.proc.wait()
            raise RuntimeError(
                f"worker {self.spec} exited with status {code}"
                + (f" (signal {-code})" if code < 0 else "")
            )
        return json.loads(line)

    def round(self):
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()
        return self.read()

    def close(self):
        if self.proc.poll() is None:
            self.proc.stdin.close()
            self.proc.wait()


def disk_bytes(name: str, args) -> int:
    """The weights as stored: the run folder's safetensors files, or the GGUF file."""
    if name == "llama.cpp":
        from compress.io.source import embedded_gguf

        return Path(args.gguf or embedded_gguf(args.model)).stat().st_size
    named = folder_system(name, args)
    folder = named[0] if named else {"ours-int4": args.int4, "ours-int3": args.int3}.get(name[:9])
    folder = Path(folder or args.fp)
    return sum(f.stat().st_size for f in folder.glob("*.safetensors"))


def table(results: dict, bandwidth: float | None = None) -> list[str]:
    """The decode table; ``bandwidth`` (bytes/s of the copy) adds how close each row runs to the
    memory limit."""
    hf = results.get("hf-fp32", {}).get("decode_tok_s")
    cpp = results.get("llama.cpp", {}).get("decode_tok_s")
    nan = float("nan")
    lines = [
        "| system | decode tok/s | prefill tok/s | peak MiB (decode) | in memory MiB | on disk MiB "
        "| KV B/token | decode vs hf-fp32 | decode vs llama.cpp | read MiB/token | of bandwidth |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in results.items():
        if "decode_tok_s" not in r:
            lines.append(f"| {name} | {r.get('error', 'no result')} | | | | | | | | | |")
            continue
        d, read = r["decode_tok_s"], r.get("read_bytes")
        share = d * read / bandwidth if read and bandwidth else nan
        lines.append(
            f"| {name} | {d:.1f} | {r.get('prefill_tok_s', nan):.0f} | "
            f"{r['peak_mem_bytes'] / 2**20:.0f} | {r['memory_bytes'] / 2**20:.0f} | "
            f"{r['disk_bytes'] / 2**20:.0f} | {r.get('kv_bytes_per_token') or nan:.0f} | "
            f"{d / hf if hf else nan:.2f}x | "
            f"{d / cpp if cpp else nan:.2f}x | {(read or nan) / 2**20:.1f} | {share:.2f} |"
        )
    return lines


def ratios(results: dict) -> list[str]:
    """For each int4 row: speed against hf-fp32 and llama.cpp (and int3 against it), memory
    against ours-fp32 (ours-fp32+compile for a compiled row, if measured: compiling holds memory
    of its own)."""
    hf, cpp = (results.get(k, {}) for k in ("hf-fp32", "llama.cpp"))
    out = []
    for name in (s for s in SYSTEMS if s.startswith("ours-int4")):
        q = results.get(name, {})
        if "decode_tok_s" not in q:
            continue
        if "decode_tok_s" in cpp and ("w4a8" in name or name == "ours-int4-default"):
            r = q["decode_tok_s"] / cpp["decode_tok_s"]
            out.append(f"{name} / llama.cpp decode: {r:.2f}x")
        three = results.get(name.replace("ours-int4", "ours-int3"), {})
        if "decode_tok_s" in three and "w4a8" in name:
            r = three["decode_tok_s"] / q["decode_tok_s"]
            out.append(f"{name.replace('ours-int4', 'ours-int3')} / {name} decode: {r:.2f}x")
        fp = (
            "ours-fp32+compile"
            if name.endswith("+compile") and "ours-fp32+compile" in results
            else "ours-fp32"
        )
        f = results.get(fp, {})
        if "decode_tok_s" in hf:
            r = q["decode_tok_s"] / hf["decode_tok_s"]
            out.append(f"{name} / hf-fp32 decode: {r:.2f}x")
        if "decode_tok_s" in cpp and not ("w4a8" in name or name == "ours-int4-default"):
            r = q["decode_tok_s"] / cpp["decode_tok_s"]
            out.append(f"{name} / llama.cpp decode: {r:.2f}x")
        if "peak_mem_bytes" in f:
            saved, wdiff = (
                f["peak_mem_bytes"] - q["peak_mem_bytes"],
                f["disk_bytes"] - q["disk_bytes"],
            )
            out.append(
                f"{name}: decode peak memory below {fp}'s by {saved / 2**20:.0f} MiB; the weights "
                f"on disk differ by {wdiff / 2**20:.0f} MiB"
            )
    return out


LONG_KVS = ["fp16", "kivi:bits=4", "packkv"]  # --contexts' caches unless --kvs names others


def check_kvs(kvs: list[str]) -> None:
    """Each ``--kvs`` entry names a cache kind and only options it has (before any worker loads)."""
    from compress.decoder.kv import CACHES

    for spec in kvs:
        kind, opts = kv_spec(spec)
        if kind not in CACHES:
            raise ValueError(f"unknown cache '{kind}' in '{spec}'; use one of {list(CACHES)}")
        unknown = set(opts) - set(CACHES[kind].OPTIONS)
        if unknown:
            raise ValueError(f"'{spec}': {kind} has no option(s) {sorted(unknown)}")


def phases(systems: list[str], args) -> list[tuple[str, list[str]]]:
    """``(task, systems)`` run one after another: decode of the short-prompt systems, decode of
    each context's systems (its own workers), then prefill of the short-prompt systems (the
    rows without +compile: prefill runs eagerly either way)."""
    context = {n: (folder_system(n, args) or (None, None, None))[2] for n in systems}
    short = [n for n in systems if not context[n]]
    out = [("decode", short)] if short else []
    for n in dict.fromkeys(c for c in context.values() if c):
        out.append(("decode", [s for s in systems if context[s] == n]))
    prefill = [n for n in short if not n.endswith("+compile") and not args.no_prefill]
    return out + ([("prefill", prefill)] if prefill else [])


def context_table(results: dict, args) -> list[str]:
    """One row per ``NAME[KV]@N`` system, with its decode speed over the fp16 cache's at N."""
    lines = [
        (
            "| context | folder | cache | decode tok/s | vs fp16 | peak MiB (decode) | KV MiB "
            "| KV B/token | prefill tok/s (the prompt) |"
        ),
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in results.items():
        parsed = FOLDER_SYSTEM.match(name)
        if not parsed or not parsed["context"]:
            continue
        n, base, kv = int(parsed["context"]), parsed["base"], parsed["kv"]
        head = f"| {n} | {base} | {kv} |"
        if "decode_tok_s" not in r:
            lines.append(f"{head} {r.get('error', 'no result')} | | | | | |")
            continue
        fp16 = results.get(f"{base}[fp16]@{n}", {}).get("decode_tok_s")
        d, nan = r["decode_tok_s"], float("nan")
        lines.append(
            f"{head} {d:.1f} | {d / fp16 if fp16 else nan:.2f}x | "
            f"{r['peak_mem_bytes'] / 2**20:.0f} | {(r.get('kv_bytes') or nan) / 2**20:.1f} | "
            f"{r.get('kv_bytes_per_token') or nan:.0f} | {r.get('prefill_tok_s', nan):.0f} |"
        )
    return lines


def context_ratios(results: dict, args) -> list[str]:
    """Each compressed cache's decode speed against the fp16 cache's at the same context."""
    out = []
    for name, r in results.items():
        parsed = FOLDER_SYSTEM.match(name)
        if not parsed or not parsed["context"] or parsed["kv"] == "fp16":
            continue
        n, base = int(parsed["context"]), parsed["base"]
        fp16 = results.get(f"{base}[fp16]@{n}", {})
        if "decode_tok_s" not in r or "decode_tok_s" not in fp16:
            continue
        out.append(f"{name} / fp16 cache decode: {r['decode_tok_s'] / fp16['decode_tok_s']:.2f}x")
    return out


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--int4", help="int4 run folder (awq_int4 or rtn_int4)")
    p.add_argument("--int3", help="int3 run folder (awq_int3) for the ours-int3 rows")
    p.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        help="the embedded model whose GGUF llama.cpp decodes and whose converted folder is "
        "--fp's default (compress.io.embedded: smollm2-135m, gemma3-270m)",
    )
    p.add_argument("--fp", help="fp32 HF folder (default: --model's, converted)")
    p.add_argument("--gguf", help="the GGUF llama.cpp decodes (default: --model's own)")
    p.add_argument("--no-prefill", action="store_true", help="time decoding only")
    p.add_argument(
        "--systems",
        nargs="*",
        choices=SYSTEMS,
        default=None,
        help="default: all but the q16 and head rows (the W4A8 int8-head rows included; the "
        "int3 rows with --int3); none when --folders is given",
    )
    p.add_argument(
        "--folders",
        nargs="*",
        default=[],
        metavar="NAME=PATH",
        help="run folders (e.g. attention conversions) decoded fp32 with each --kvs cache",
    )
    p.add_argument(
        "--kvs",
        nargs="*",
        default=None,
        help="KV caches for --folders, with options: fp16 kivi:bits=4 packkv:k_rel=0.04 "
        f"(default: fp16; with --contexts: {' '.join(LONG_KVS)})",
    )
    p.add_argument(
        "--contexts",
        nargs="*",
        type=int,
        default=[],
        metavar="N",
        help="prompt lengths for the context-length axis, e.g. 512 2048 8000 (the default "
        "model's folder unless --folders)",
    )
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--new", type=int, default=128)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--prefill-len", type=int, default=512)
    p.add_argument(
        "--threads",
        type=int,
        nargs="+",
        default=[2],
        help="torch threads, and llama.cpp's n_threads; several: one run (and table) each",
    )
    p.add_argument("--json", help="write the results here too")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.fp is None:
        from compress.io.source import convert_embedded

        args.fp = str(convert_embedded(args.model))
    if args.worker:
        return worker(args.worker, args)
    if args.systems is None:
        args.systems = (
            []
            if args.folders or args.contexts
            else [
                s
                for s in SYSTEMS
                if "q16" not in s
                and ("head" not in s or "w4a8-head8" in s)
                and (args.int3 or not s.startswith("ours-int3"))
            ]
        )
    bad = [f for f in args.folders if "=" not in f or not Path(f.split("=", 1)[1]).is_dir()]
    if bad:
        sys.exit(f"error: --folders takes NAME=PATH with PATH a run folder; not {bad}")
    if args.contexts and not args.folders:
        args.folders = [f"default={args.fp}"]
    kvs = args.kvs or (LONG_KVS if args.contexts else ["fp16"])
    try:
        check_kvs(kvs)
    except ValueError as e:
        sys.exit(f"error: --kvs: {e}")
    names = [f.split("=", 1)[0] for f in args.folders]
    if args.contexts:
        args.systems += [f"{b}[{kv}]@{n}" for n in args.contexts for b in names for kv in kvs]
    else:
        args.systems += [f"{b}[{kv}]" for b in names for kv in kvs]
    if any(s.startswith("ours-int4") for s in args.systems) and not args.int4:
        sys.exit("error: --int4 RUN_FOLDER is needed for ours-int4 (or leave it out of --systems)")
    if any(s.startswith("ours-int3") for s in args.systems) and not args.int3:
        sys.exit("error: --int3 RUN_FOLDER is needed for ours-int3 (or leave it out of --systems)")
    everything = {}
    for threads in args.threads:
        passthrough = _strip(argv, {"--systems", "--json", "--folders", "--threads"})
        passthrough += ["--threads", str(threads), "--fp", args.fp, "--folders", *args.folders]
        passthrough += ["--systems"]
        everything[threads] = run_threads(args, passthrough, threads)
    if args.json:
        out = everything if len(args.threads) > 1 else everything[args.threads[0]]
        tmp = Path(args.json).with_suffix(".tmp")
        tmp.write_text(json.dumps(out, indent=1))
        tmp.replace(args.json)


def run_threads(args, passthrough: list[str], threads: int) -> dict:
    """Every phase on ``threads`` threads: the results by system, and the copy bandwidth."""
    bandwidth = copy_bandwidth(threads)
    print(f"copy bandwidth, {threads} threads: {bandwidth / 1e9:.1f} GB/s", file=sys.stderr)
    load_before = os.getloadavg()[0]
    results = {name: {"disk_bytes": disk_bytes(name, args)} for name in args.systems}
    rounds = {}
    for task, group in phases(args.systems, args):
        # separate processes: each has its own peak RSS; one phase (and context) at a time
        workers = {}
        for name in group:
            try:
                workers[name, task] = Worker(f"{name}:{task}", passthrough)
                rounds[name, task] = []
            except RuntimeError as e:
                results[name]["error"] = str(e)
        for i in range(args.rounds + 1):
            for key, w in list(workers.items()):
                try:
                    r = w.round()
                except RuntimeError as e:
                    results[key[0]]["error"] = str(e)
                    del workers[key]
                    continue
                if i:
                    rounds[key].append(r)
            context = (folder_system(group[0], args) or (None, None, None))[2] if group else None
            where = f" ({context}-token context)" if context else ""
            print(f"{task}{where} round {i}/{args.rounds} done", file=sys.stderr)
        for w in workers.values():
            w.close()
    for (name, task), rs in rounds.items():
        if len(rs) == args.rounds:
            results[name][f"{task}_tok_s"] = statistics.median(r["tok_s"] for r in rs)
            if task == "decode":
                results[name]["peak_mem_bytes"] = max(r["peak_mem_bytes"] for r in rs)
                results[name]["memory_bytes"], results[name]["text"] = (
                    rs[-1]["memory_bytes"],
                    rs[-1]["text"],
                )
                results[name]["kv_bytes_per_token"] = rs[-1]["kv_bytes_per_token"]
                results[name]["kv_bytes"] = rs[-1]["kv_bytes"]
                results[name]["read_bytes"] = rs[-1]["read_bytes"]
                results[name]["decode_rounds"] = [r["tok_s"] for r in rs]
                if folder_system(name, args) and folder_system(name, args)[2]:
                    results[name]["prefill_tok_s"] = statistics.median(
                        r["prompt_prefill_tok_s"] for r in rs
                    )
    short = [n for n in args.systems if not (folder_system(n, args) or [0, 0, 0])[2]]
    if short:
        print(
            f"batch 1, {args.prompt_len}-token prompt + {args.new} new tokens (greedy, EOS "
            f"ignored); prefill {args.prefill_len} tokens; median of {args.rounds} after a "
            f"warm-up; torch threads {threads}; load average {load_before:.1f} before, "
            f"{os.getloadavg()[0]:.1f} after"
        )
        sub = {n: results[n] for n in short}
        print(f"copy bandwidth (STREAM-like, {threads} threads): {bandwidth / 1e9:.1f} GB/s")
        print("\n".join(table(sub, bandwidth) + [""] + ratios(sub)))
    if args.contexts:
        print(
            f"\nbatch 1, WikiText-2 prompts of {', '.join(map(str, args.contexts))} tokens + "
            f"{args.new} new tokens (greedy, EOS ignored); fp32 model, attention in fp32; median "
            f"of {args.rounds} after a warm-up; torch threads {threads}; load average "
            f"{load_before:.1f} before, {os.getloadavg()[0]:.1f} after"
        )
        print("\n".join(context_table(results, args) + [""] + context_ratios(results, args)))
    results["copy_bandwidth_bytes_s"] = bandwidth
    return results


def _strip(argv, flags) -> list[str]:
    """``argv`` without the given options and their values."""
    out, skip = [], False
    for a in argv:
        if skip and not a.startswith("--"):
            continue
        skip = a in flags
        if not skip:
            out.append(a)
    return out


if __name__ == "__main__":
    main()
