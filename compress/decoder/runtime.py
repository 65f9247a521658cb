"""The runtime configuration: one frozen :class:`RuntimeConfig`, resolved once by
:func:`resolve_runtime` from (folder, device, the settings the user named). The decoder CLI, a
``--draft`` folder, the server, the Python API and ``report.json``'s ``decoder_default`` all
call it, and ``compress.decoder.model.load(folder, runtime=...)`` loads a folder in it.

Every setting the user did not name takes the fast choice for the folder and device; a named
setting replaces only itself. The fast choice, on the CPU for a group-quantized folder: the
model in bfloat16 (the int layers through ATen's int4pack kernel, as AutoAWQ and vLLM compute in
16-bit), lean weights, the quantized layers computing with ``FAST_KERNEL``, the output head
quantized to ``FAST_HEAD`` when the folder records none, and the compiled step (fp16 or full
cache, no draft); serving adds batch invariance (W4A8 at every batch size, attention in a fixed
order) in place of the compiled step. ``dtype=float32`` names the bit-faithful path of the
pipeline's evaluation: the settings not named then keep it (exact kernel, the recorded head,
eager). Other folders and devices run float32, exact, eager.

Where a named setting rules out a fast choice, the compatible choice is taken for the setting
not named: a ``qdtype`` other than bfloat16 turns the lean default off (lean keeps only a
bfloat16 form); serving, a named ``kernel=exact``, ``head=none``, a ``qdtype`` other than
bfloat16 or ``batch_invariant=False`` turn invariance (and with it the lean default) off. Two
named settings that cannot hold together, or a named setting the folder or device cannot run,
are refused with a ``CompressError`` naming both and the fix (:func:`check_runtime`), before
anything loads.

``FAST_KERNEL`` and ``FAST_HEAD`` stay the default only while they are faster and cost at most
0.3% ppl against W4A16 on 40 windows (``decode.kernel=w4a8`` in a recipe reports the cost).
"""

import json
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import torch

from compress.decoder.devices import check_device
from compress.errors import CompressError
from compress.layers import GROUP_QUANTIZED
from compress.layers.head import recorded_head

FAST_DTYPE = "bfloat16"
FAST_KERNEL = "w4a8"  # int8 activations, integer dot products (compress.kernels.w4a8_cpu)
FAST_HEAD = "int8"  # the head group-quantized to int8 at load (compress.layers.head)


@dataclass(frozen=True)
class RuntimeConfig:
    """How a folder runs. ``device``: where it loads and computes; ``dtype``: the embedding,
    norms, attention and head; ``qdtype``: what the group-quantized layers compute in;
    ``kernel``: ``exact`` or ``w4a8``; ``head``: ``none``, ``int8`` or ``int4``; ``lean``: only
    the int4pack (or W4A8) form of each int layer is kept; ``compile``: the static-shape
    compiled decode step; ``batch_invariant``: W4A8 at every batch size and fixed-order
    attention (serving); ``threads``: torch's CPU threads, set at load (None: torch's default);
    ``fast``: whether the fast choice filled the settings not named."""

    device: str = "cpu"
    dtype: str = "float32"
    qdtype: str = "float32"
    kernel: str = "exact"
    head: str = "none"
    lean: bool = False
    compile: bool = False
    batch_invariant: bool = False
    threads: int | None = None
    fast: bool = False

    def as_dict(self) -> dict:
        """The fields, for JSON (``--json``'s ``runtime``, ``report.json``'s ``decoder_default``)."""
        return asdict(self)

    def describe(self, label: str = "runtime") -> str:
        """One line for stderr and the server's log."""
        flags = [f"device {self.device}", f"dtype {self.dtype}", f"qdtype {self.qdtype}"]
        flags += [f"kernel {self.kernel}", f"head {self.head}"]
        flags += [f"threads {self.threads}"] * bool(self.threads)
        flags += [n for n in ("lean", "compile", "batch_invariant") if getattr(self, n)]
        how = (
            "the fast default for the settings not named; dtype float32 for the bit-faithful path"
            if self.fast
            else "the exact path"
        )
        return f"[{label}: {', '.join(flags)} ({how})]"

    def load_kwargs(self) -> dict:
        """``compress.decoder.model.load`` keywords (for a method's loader that wraps it, as
        IAM's does; the decoder's own loader takes ``runtime=`` itself)."""
        return dict(
            device=self.device,
            dtype=getattr(torch, self.dtype),
            qdtype=getattr(torch, self.qdtype),
            lean=self.lean,
            head=self.head,
            kernel=self.kernel,
        )


# the settings a user names (device is resolve_runtime's own argument; fast is derived)
SETTINGS = tuple(f.name for f in fields(RuntimeConfig) if f.name not in ("device", "fast"))
DTYPES = ("float32", "bfloat16", "float16")
CHOICES = {
    "dtype": DTYPES,
    "qdtype": DTYPES,
    "kernel": ("exact", "w4a8"),
    "head": ("none", "int8", "int4"),
}


def named_settings(args) -> dict:
    """The runtime settings an argparse namespace names (a flag left out is None: not named)."""
    return {k: getattr(args, k, None) for k in SETTINGS}


def _config(folder) -> dict:
    """``folder``'s config.json, or {} when it cannot be read as a JSON object (the loader
    then refuses the folder with its own clear error)."""
    try:
        raw = json.loads((Path(folder) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return raw if isinstance(raw, dict) else {}


def fast_head(folder) -> str:
    """``FAST_HEAD``, or none when the folder's vocabulary does not fill whole packed words
    (``compress.layers.head`` needs a multiple of 32 rows)."""
    vocab = _config(folder).get("vocab_size")
    return FAST_HEAD if isinstance(vocab, int) and vocab % 32 == 0 else "none"


def group_quantized(folder) -> bool:
    """Whether ``folder``'s config.json names a group-quantized format (compressed-tensors,
    awq, compress)."""
    qcfg = _config(folder).get("quantization_config")
    return isinstance(qcfg, dict) and qcfg.get("quant_method") in GROUP_QUANTIZED


def _check_named(given: dict) -> None:
    """Refuse a setting that is not one, or a value no setting takes."""
    unknown = sorted(set(given) - set(SETTINGS))
    if unknown:
        raise CompressError(
            f"unknown runtime setting(s) {unknown}; the settings are {', '.join(SETTINGS)}."
        )
    for name, choices in CHOICES.items():
        if name in given and given[name] not in choices:
            raise CompressError(
                f"{name}={given[name]!r}: use one of {', '.join(choices)} (or leave it out for "
                f"the fast choice)."
            )
    for name in ("lean", "compile", "batch_invariant"):
        if name in given and not isinstance(given[name], bool):
            raise CompressError(f"{name}={given[name]!r}: give True or False (or leave it out).")
    threads = given.get("threads")
    if threads is not None and (
        isinstance(threads, bool) or not isinstance(threads, int) or threads < 1
    ):
        raise CompressError(f"threads={threads!r}: give a number of CPU threads >= 1.")


def resolve_runtime(
    folder,
    device: str = "cpu",
    named: dict | None = None,
    *,
    static_cache: bool = True,
    serving: bool = False,
) -> RuntimeConfig:
    """The configuration ``folder`` runs in on ``device`` (module docstring). ``named``: the
    settings the user gave (``SETTINGS`` keys; None values count as not named).
    ``static_cache``: the cache and draft allow the compiled step (fp16 or full cache, no
    draft). ``serving``: the server's choice (batch invariance instead of the compiled step;
    ``named`` may hold ``batch_invariant=False`` for a path that cannot be invariant)."""
    given = {k: v for k, v in (named or {}).items() if v is not None}
    _check_named(given)
    device = check_device(device, "device")
    cpu = torch.device(device).type == "cpu"
    quantized = group_quantized(folder)
    fast = cpu and quantized and given.get("dtype", FAST_DTYPE) != "float32"
    dtype = given.get("dtype", FAST_DTYPE if fast else "float32")
    qdtype = given.get("qdtype", dtype)
    kernel = given.get("kernel", FAST_KERNEL if fast else "exact")
    head = given.get("head", recorded_head(folder))
    if fast and "head" not in given and head == "none":
        head = fast_head(folder)
    if serving:
        invariant = fast and kernel == FAST_KERNEL and head != "none" and qdtype == FAST_DTYPE
        invariant = given.get("batch_invariant", invariant)
        if invariant and "head" not in given and head == "none":
            head = fast_head(folder)  # a float head would change a row's bits with the batch
        kernel = FAST_KERNEL if invariant else kernel
        lean = given.get("lean", invariant)
        compile_ = given.get("compile", False)
    else:
        invariant = given.get("batch_invariant", False)
        lean = given.get("lean", fast and qdtype == "bfloat16")
        compile_ = given.get("compile", fast and static_cache)
    conf = RuntimeConfig(
        device=device,
        dtype=dtype,
        qdtype=qdtype,
        kernel=kernel,
        head=head,
        lean=bool(lean),
        compile=bool(compile_),
        batch_invariant=bool(invariant),
        threads=given.get("threads"),
        fast=fast,
    )
    check_runtime(conf, folder, given, quantized)
    return conf


def check_runtime(conf: RuntimeConfig, folder, given: dict, quantized: bool) -> None:
    """Refuse a configuration the loader, the compiled step or the server would refuse later
    (after reading the weights), naming the settings in conflict and the fix. ``given``: the
    named settings (a conflict is always between named settings, or a named setting and the
    folder or device: the defaults are chosen to fit)."""

    def who(name: str) -> str:
        value = getattr(conf, name)
        shown = value if not isinstance(value, bool) else str(value).lower()
        return f"{name}={shown} ({'named' if name in given else 'the default'})"

    cpu = torch.device(conf.device).type == "cpu"
    if conf.compile and not cpu:
        raise CompressError(
            f"compile=true names the static compiled decode step, which is for the CPU, and the "
            f"device is {conf.device} (on CUDA the Triton kernels already fuse the work): "
            f"leave out --compile, or use --device cpu."
        )
    if conf.lean and not cpu:
        raise CompressError(
            f"lean=true keeps only the CPU's int4pack form of the quantized layers, and the "
            f"device is {conf.device}: leave out --lean, or use --device cpu."
        )
    if conf.lean and quantized and conf.qdtype != "bfloat16" and conf.kernel != FAST_KERNEL:
        raise CompressError(
            f"lean=true keeps only the bfloat16 int4pack form of the quantized layers, and "
            f"{who('qdtype')} with {who('kernel')} computes them in another dtype: name "
            f"--dtype bfloat16 (or --qdtype bfloat16), or leave out --lean."
        )
    vocab = _config(folder).get("vocab_size")
    if "head" in given and conf.head != "none" and isinstance(vocab, int) and vocab % 32:
        raise CompressError(
            f"head={conf.head} quantizes the output head in packed words of 32 rows, and the "
            f"folder's vocabulary has {vocab} rows, not a multiple of 32: leave out --head (or "
            f"--head none)."
        )
    if not conf.batch_invariant:
        return
    if "kernel" in given and given["kernel"] != FAST_KERNEL:
        raise CompressError(
            f"batch invariance computes the quantized layers with {FAST_KERNEL} at every "
            f"batch size, and kernel {given['kernel']} was named: leave out one of the two."
        )
    if not (cpu and quantized):
        raise CompressError(
            f"batch invariance needs every linear layer through the CPU's {FAST_KERNEL} "
            f"kernel, so a group-quantized folder (awq, compress) on the CPU; "
            f"'{folder}' on {conf.device} is not: leave out --batch-invariant."
        )
    if conf.head == "none":
        why = "named" if "head" in given else "the vocabulary is not a multiple of 32"
        raise CompressError(
            f"batch invariance needs the output head quantized too (a float head's bits change "
            f"with the batch), and head=none ({why}): name --head int8, or leave out "
            f"--batch-invariant."
        )
