"""A quantized layer's tensors on disk when they are not its buffers: the compressed-tensors
format (``compress.formats.compressed_tensors``).

In memory a ``QuantLinear`` keeps the layout its kernels read (AutoAWQ GEMM at INT4, bit planes
otherwise); a ``compressed-tensors`` folder stores each of those layers as ``weight_packed``,
``weight_scale``, ``weight_zero_point`` and ``weight_shape``. A :class:`Codec` repacks the same
codes between the two, one layer at a time, for the loaders (``compress.io``) and the writer.
"""

from dataclasses import dataclass

import torch
from torch import nn

from compress.errors import CompressError
from compress.formats import compressed_tensors as ct
from compress.layers.quant_linear import QuantLinear, buffer_codes, pack_buffers


@dataclass(frozen=True)
class Coded:
    """One quantized layer: its shape and scheme."""

    out_features: int
    in_features: int
    bits: int
    group_size: int
    symmetric: bool


class Codec:
    """Between the buffers of ``model``'s ``QuantLinear`` layers and compressed-tensors' names.

    Names are full state-dict names; a layer's ``bias`` is stored under its own name."""

    def __init__(self, model: nn.Module, qcfg: dict, expert_scales=torch.float16):
        self.expert_scales = expert_scales  # the dtype of experts' stored scales (encode)
        self.layers: dict[str, Coded] = {}
        self.buffers: dict[str, list[str]] = {}  # each layer's packed buffers (not its bias)
        for name, m in model.named_modules():
            if isinstance(m, QuantLinear):
                symmetric = (ct.scheme(qcfg, name) or (0, 0, False))[2]
                self.layers[name] = Coded(
                    m.out_features, m.in_features, m.bits, m.group_size, symmetric
                )
                self.buffers[name] = [k for k in m._buffers if k != "bias"]

    def owner(self, name: str) -> str | None:
        """The coded layer whose buffer ``name`` is, else None (stored as it is)."""
        prefix, _, local = name.rpartition(".")
        return prefix if prefix in self.layers and local != "bias" else None

    def disk_names(self, prefix: str) -> list[str]:
        symmetric = self.layers[prefix].symmetric  # no zero point stored
        return [f"{prefix}.{k}" for k in ct.NAMES if not (symmetric and k == "weight_zero_point")]

    def decode(self, prefix: str, disk: dict) -> dict[str, torch.Tensor]:
        """The layer's buffers (full names) from its stored tensors (full names)."""
        c = self.layers[prefix]
        local = {n.rpartition(".")[2]: t for n, t in disk.items()}
        self._check({f"{prefix}.{k}": (tuple(t.shape),) for k, t in local.items()}, prefix)
        shape = tuple(int(v) for v in local["weight_shape"].tolist())
        if shape != (c.out_features, c.in_features):
            raise CompressError(
                f"tensor '{prefix}.weight_shape' is {shape}, but the config expects "
                f"{(c.out_features, c.in_features)}; the checkpoint does not match its config.json."
            )
        q, z, s = ct.decode(local, c.bits, c.symmetric)
        out = pack_buffers(q.t().contiguous(), z.t().contiguous(), c.bits)
        out["scales"] = s.t().to(torch.float16).contiguous()
        return {f"{prefix}.{k}": t for k, t in out.items()}

    def encode(self, prefix: str, value) -> dict[str, tuple]:
        """``{stored name: (shape, dtype, read)}`` of one layer; ``value(buffer name)`` reads a
        buffer (full name), ``read()`` makes the stored tensor."""
        c = self.layers[prefix]
        shapes = ct.shapes(c.out_features, c.in_features, c.bits, c.group_size, c.symmetric)
        dtypes = {"weight_packed": torch.int32, "weight_zero_point": torch.int32}
        scale = self.expert_scales if ".experts." in prefix else torch.float16
        dtypes.update(weight_scale=scale, weight_shape=torch.int64)

        made = {}  # the layer's stored tensors, made at the first read, each handed out once

        def read(k: str) -> torch.Tensor:
            if k not in made:
                buffers = {b: value(f"{prefix}.{b}") for b in self.buffers[prefix]}
                q_t, z_t = buffer_codes(buffers, c.bits)
                s = buffers["scales"].t().to(scale).contiguous()
                made.update(ct.encode(q_t.t().contiguous(), z_t.t(), s, c.bits, c.symmetric))
            return made.pop(k)

        return {
            f"{prefix}.{k}": (shape, dtypes[k], lambda k=k: read(k)) for k, shape in shapes.items()
        }

    def decode_all(self, tensors: dict, complete: bool = False, done: set | None = None) -> dict:
        """``tensors`` (a whole checkpoint) with every coded layer's stored tensors replaced by
        its buffers. ``complete``: only the layers whose stored tensors are all there (the shards
        read so far); ``done``: the layers decoded already, skipped, and added to."""
        done = set() if done is None else done
        for prefix in self.layers:
            names = self.disk_names(prefix)
            if prefix in done or (complete and not all(n in tensors for n in names)):
                continue
            stored = {n: tensors.pop(n) for n in names if n in tensors}
            tensors.update(self.decode(prefix, stored))
            done.add(prefix)
        return tensors

    def _check(self, stored: dict, prefix: str) -> None:
        """``stored`` (``{name: (shape, ...)}``) holds layer ``prefix``'s tensors in their shapes."""
        c = self.layers[prefix]
        shapes = ct.shapes(c.out_features, c.in_features, c.bits, c.group_size, c.symmetric)
        for k, shape in shapes.items():
            got = stored.get(f"{prefix}.{k}")
            if got is None:
                raise CompressError(
                    f"the checkpoint lacks tensor '{prefix}.{k}' of quantized layer "
                    f"'{prefix}'; it does not match its config.json's quantization_config."
                )
            if tuple(got[0]) != shape:
                raise CompressError(
                    f"tensor '{prefix}.{k}' has shape {tuple(got[0])}, but the config "
                    f"expects {shape}; the checkpoint does not match its config.json."
                )

    def headers(self, headers: dict) -> dict:
        """Stored ``{name: (shape, dtype)}`` checked and mapped to the buffers' names and shapes."""
        out = dict(headers)
        for prefix, c in self.layers.items():
            self._check(out, prefix)
            for name in self.disk_names(prefix):
                out.pop(name)
            with torch.device("meta"):
                layer = QuantLinear(c.in_features, c.out_features, c.bits, c.group_size)
            out.update(
                {f"{prefix}.{k}": (tuple(t.shape), t.dtype) for k, t in layer._buffers.items()}
            )
        return out


def codec_for(model: nn.Module, qcfg: dict | None, dtype=None) -> Codec | None:
    """A :class:`Codec` when ``qcfg`` is compressed-tensors', else None (the buffers are stored
    under their own names). ``dtype``: the checkpoint's float dtype, in which experts' scales
    are stored, since transformers decompresses experts into their scales' dtype and then
    computes them in the model's (a bfloat16 folder's expert scales are the float16 ones
    rounded to bfloat16, relative error at most 2^-9)."""
    if (qcfg or {}).get("quant_method") != ct.METHOD:
        return None
    floats = (torch.float16, torch.bfloat16, torch.float32)
    return Codec(model, qcfg, dtype if dtype in floats else torch.float16)
