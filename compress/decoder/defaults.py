"""The decoder's fast configuration: what ``python -m compress.decoder`` (and a ``--draft``
folder) runs by default on a group-quantized folder on the CPU.

The quantized layers compute with ``FAST_KERNEL`` and the output head is quantized to
``FAST_HEAD`` when the folder records none. Each is the default only while it is faster and its
measured cost stays within 0.3% ppl of the W4A16 path on 40 windows (``decode.kernel=w4a8`` in a recipe
reports the kernel's, ``compress.eval.kernel_cost``); ``--kernel exact --head none`` or
``--dtype float32`` (the bit-faithful path) turn them off.
"""

import json
from pathlib import Path

# w4a8: int8 activations and integer dot products (compress.kernels.w4a8_cpu), called as a C++
# torch operator from the compiled step; within the ppl bar and faster than the int4pack path
# (python eval/bench/bench_decode.py --int4 outputs/awq_int4 --systems
# ours-int4-default ours-int4-bf16-lean-head8+compile llama.cpp --threads 2 1)
FAST_KERNEL = "w4a8"
FAST_HEAD = "int8"  # the head group-quantized to int8 at load (compress.layers.head)


def fast_head(folder) -> str:
    """``FAST_HEAD``, or none when the folder's vocabulary does not fill whole packed words
    (``compress.layers.head`` needs a multiple of 32 rows)."""
    path = Path(folder) / "config.json"
    vocab = json.loads(path.read_text()).get("vocab_size") if path.is_file() else None
    return FAST_HEAD if isinstance(vocab, int) and vocab % 32 == 0 else "none"


def group_quantized(folder) -> bool:
    """Whether ``folder``'s config.json names a group-quantized format (awq, compress)."""
    path = Path(folder) / "config.json"
    if not path.is_file():
        return False
    qcfg = json.loads(path.read_text()).get("quantization_config") or {}
    return qcfg.get("quant_method") in ("awq", "compress")
