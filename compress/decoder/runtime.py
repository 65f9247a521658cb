"""The runtime configuration: one frozen :class:`RuntimeConfig`, resolved once by
:func:`resolve_runtime` from (folder, device, the settings the user named). The decoder CLI, a
``--draft`` folder, the server, the Python API and ``report.json``'s ``decoder_default`` all
call it, and :func:`compress.decoder.model.load_runtime` loads a folder in it.

Every setting the user did not name takes the fast choice for the folder and device; a named
setting replaces only itself. The fast choice, on the CPU for a group-quantized folder: the
model in bfloat16 (the int layers through ATen's int4pack kernel, as AutoAWQ and vLLM compute in
16-bit), lean weights, the quantized layers computing with ``FAST_KERNEL``, the output head
quantized to ``FAST_HEAD`` when the folder records none, and the compiled step (fp16 or full
cache, no draft); serving adds batch invariance (W4A8 at every batch size, attention in a fixed
order) in place of the compiled step. ``dtype=float32`` names the bit-faithful path of the
pipeline's evaluation: the settings not named then keep it (exact kernel, the recorded head,
eager). Other folders and devices run float32, exact, eager.

``FAST_KERNEL`` and ``FAST_HEAD`` stay the default only while they are faster and cost at most
0.3% ppl against W4A16 on 40 windows (``decode.kernel=w4a8`` in a recipe reports the cost).
"""

import json
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import torch

from compress.errors import CompressError
from compress.layers.head import recorded_head

FAST_DTYPE = "bfloat16"
FAST_KERNEL = "w4a8"  # int8 activations, integer dot products (compress.kernels.w4a8_cpu)
FAST_HEAD = "int8"  # the head group-quantized to int8 at load (compress.layers.head)


@dataclass(frozen=True)
class RuntimeConfig:
    """How a folder runs. ``dtype``: the embedding, norms, attention and head; ``qdtype``: what
    the group-quantized layers compute in; ``kernel``: ``exact`` or ``w4a8``; ``head``: ``none``,
    ``int8`` or ``int4``; ``lean``: only the int4pack form of each int layer is kept;
    ``compile``: the static-shape compiled decode step; ``batch_invariant``: W4A8 at every
    batch size and fixed-order attention (serving); ``threads``: torch's CPU threads (None: its
    default); ``fast``: whether the fast choice filled the settings not named."""

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
        return asdict(self)

    def describe(self) -> str:
        """One line for stderr and the server's log."""
        flags = [f"dtype {self.dtype}", f"qdtype {self.qdtype}", f"kernel {self.kernel}"]
        flags += [f"head {self.head}"] + [f"threads {self.threads}"] * bool(self.threads)
        flags += [n for n in ("lean", "compile", "batch_invariant") if getattr(self, n)]
        how = (
            "the fast default for the settings not named; dtype float32 for the bit-faithful path"
            if self.fast
            else "the exact path"
        )
        return f"[runtime: {', '.join(flags)} ({how})]"

    def load_kwargs(self) -> dict:
        """``compress.decoder.model.load`` keywords."""
        return dict(
            dtype=getattr(torch, self.dtype),
            qdtype=getattr(torch, self.qdtype),
            lean=self.lean,
            head=self.head,
            kernel=self.kernel,
        )


SETTINGS = tuple(f.name for f in fields(RuntimeConfig) if f.name != "fast")


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
    """Whether ``folder``'s config.json names a group-quantized format (awq, compress)."""
    qcfg = _config(folder).get("quantization_config")
    return isinstance(qcfg, dict) and qcfg.get("quant_method") in ("awq", "compress")


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
    unknown = sorted(set(given) - set(SETTINGS))
    if unknown:
        raise CompressError(
            f"unknown runtime setting(s) {unknown}; the settings are {', '.join(SETTINGS)}."
        )
    fast = (
        device == "cpu" and group_quantized(folder) and given.get("dtype", FAST_DTYPE) != "float32"
    )
    dtype = given.get("dtype", FAST_DTYPE if fast else "float32")
    qdtype = given.get("qdtype", dtype)
    kernel = given.get("kernel", FAST_KERNEL if fast else "exact")
    head = given.get("head", recorded_head(folder))
    if fast and "head" not in given and head == "none":
        head = fast_head(folder)
    if serving:
        invariant = fast and kernel == FAST_KERNEL and head != "none" and qdtype == FAST_DTYPE
        invariant = given.get("batch_invariant", invariant)
        if invariant and given.get("kernel", FAST_KERNEL) != FAST_KERNEL:
            raise CompressError(
                f"batch invariance computes the quantized layers with {FAST_KERNEL} at every "
                f"batch size, and kernel {given['kernel']} was named: leave out one of the two."
            )
        kernel = FAST_KERNEL if invariant else kernel
        lean = given.get("lean", invariant)
        compile_ = given.get("compile", False)
    else:
        invariant = given.get("batch_invariant", False)
        lean = given.get("lean", fast and qdtype == "bfloat16")
        compile_ = given.get("compile", fast and static_cache)
    return RuntimeConfig(
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
