"""Decoding with IAM attention mapping (Zhao, Li and Zhao, ACL 2025, arXiv 2507.11953).

A small model of the same tokenizer runs first on each step's tokens, with its own cache
(``cache.RecordingCache``), and keeps the attention weights of the layers the mapping uses;
then the large model runs its one forward (``compress.decoder.model``) where each mapped layer l
is a ``MappedAttention`` (``attention.py``, an attention kind IAM registers with the decoder): it
projects V only, and its cache (``cache.MappedCache``) attends as

    y_h = P_small[m(l)][head(l, h)] V_g(h)        (no q/k projection, no K cache)

Small layers after the deepest one the mapping uses do not run. Prompts are prefilled in chunks
of ``chunk`` tokens (both models), so the weights kept at once are ``[H_s, chunk, T]`` per mapped
small layer. The gains need a large size ratio: the small model's whole pass is extra work,
and the paper maps from models many times smaller than the large one.
"""

from pathlib import Path
from types import SimpleNamespace

import torch
from torch import nn

from compress.arch.spec import spec_of
from compress.decoder.kv import new_cache
from compress.decoder.kv.base import KVLayout
from compress.decoder.kv.fp16 import FP16Cache, FullCache
from compress.decoder.model import load
from compress.errors import CompressError
from compress.io.checkpoint import read_config
from compress.methods.iam import map as iam_map
from compress.methods.iam.attention import KIND, load_mapped
from compress.methods.iam.cache import MappedCache, RecordingCache

CHUNK = 1024  # prefill tokens per pass of both models


class PairCache:
    """The small model's cache and the large model's, counted together."""

    def __init__(self, small: RecordingCache, large: MappedCache):
        self.small, self.large = small, large

    @property
    def length(self) -> int:
        return self.large.length

    def nbytes(self) -> int:
        return self.small.nbytes() + self.large.nbytes()

    def reset(self):
        self.small.reset()
        self.large.reset()

    def settle(self) -> None:
        self.small.settle()
        self.large.settle()

    def rollback(self, length: int) -> None:
        raise CompressError("IAM decoding cannot roll back its caches (no speculative decoding).")


class IAMModel(nn.Module):
    """``large`` (loaded with its mapped layers as ``MappedAttention``: :func:`load_mapped`)
    reading ``small``'s attention weights: ``mapped`` large layer -> small layer, ``heads`` large
    layer -> small head per head. Its ``spec`` is the large model's (vocabulary, stops, positions,
    layers with their attention kinds)."""

    def __init__(self, large, small, mapped: dict, heads: dict, chunk: int = CHUNK):
        super().__init__()
        self.large, self.small, self.chunk = large, small, chunk
        self.mapped = {int(k): int(v) for k, v in mapped.items()}
        self.heads = {int(k): torch.tensor(v, dtype=torch.long) for k, v in heads.items()}
        layers = large.spec.layers
        unmapped = sorted(
            ly for ly in self.mapped if not 0 <= ly < len(layers) or layers[ly].attention != KIND
        )
        if unmapped:
            raise CompressError(
                f"IAM: large layers {unmapped} are mapped but were not loaded as mapped layers "
                f"(or do not exist); load the large model with load_mapped(folder, layers)."
            )
        deepest = max(self.mapped.values(), default=-1)
        self.small_skip = tuple(range(deepest + 1, small.spec.n_layers))
        self.spec = large.spec

    @property
    def lm_head(self):
        return self.large.lm_head

    @property
    def device(self) -> torch.device:
        return self.large.device

    @property
    def dtype(self):
        return self.large.dtype

    def kv_layout(self) -> KVLayout:
        return self.large.kv_layout()

    def make_cache(self, kind: str, batch: int, max_len: int, **opts) -> PairCache:
        """The small model's recording cache (``full`` when ``kind`` is, else fp16) and the large
        model's ``kind`` cache (unmapped layers) with V-only slots (fp16, or ``full``) for the
        mapped ones."""
        device = self.large.device
        dtype = torch.float32 if device.type == "cpu" else self.large.dtype
        small = RecordingCache(
            self.small.kv_layout(), batch, max_len, dtype, device,
            keep=set(self.mapped.values()), exact=kind == "full",
        )  # fmt: skip
        inner = new_cache(self.large, kind, batch, max_len, **opts)
        lay = self.large.kv_layout()
        v_only = KVLayout(
            max(len(self.mapped), 1), lay.n_kv_heads, lay.head_dim, v_dim=lay.head_dim
        )
        values = (FullCache if kind == "full" else FP16Cache)(v_only, batch, max_len, dtype, device)
        return PairCache(small, MappedCache(inner, values, self.mapped, self.heads, small))

    def forward(self, idx, cache: PairCache, pos=None, start=None, last=False, skip=()):
        """The large model's logits; the small model runs first on the same tokens and slots."""
        if skip:
            raise CompressError("IAM decoding does not skip layers (no self-speculative drafts).")
        if pos is None:
            pos = torch.arange(cache.length, cache.length + idx.shape[1], device=idx.device)
        outs = []
        for s in range(0, idx.shape[1], self.chunk):
            part, p = idx[:, s : s + self.chunk], pos[s : s + self.chunk]
            end = s + self.chunk >= idx.shape[1]
            self.small(part, cache.small, p, start, last=True, skip=self.small_skip)
            out = self.large(part, cache.large, p, start, last=last and end)
            cache.small.probs.clear()
            if not last or end:
                outs.append(out)
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)


def check_models(large_cfg, small_cfg) -> None:
    for cfg, role in ((large_cfg, "large"), (small_cfg, "small")):
        if getattr(cfg, "cla_share", None) or getattr(cfg, "kv_lora_rank", None):
            raise CompressError(
                f"IAM maps grouped-query attention models; the {role} model's attention is "
                f"converted (cla or mla). Map its source model instead."
            )
        if spec_of(cfg).windowed:
            raise CompressError(
                f"IAM maps global-attention models; the {role} model has sliding-window "
                f"layers, whose attention weights cover their window only."
            )


def load_iam(
    large,
    small,
    layers="auto",
    map_path=None,
    dtype: torch.dtype = torch.float32,
    device="cpu",
    chunk: int = CHUNK,
    log=None,
    **load_kw,
) -> tuple[IAMModel, object]:
    """``(IAMModel, tokenizer)`` for the folders ``large`` and ``small``.

    The mapping is read from ``map_path`` (default: ``compress.methods.iam.map.map_file(large)``) and
    checked against both folders; when there is none at the default place it is made (on
    WikiText-2 validation text) and saved there. ``layers``: ``auto`` or a count.
    """

    large, small = Path(large), Path(small)
    for folder in (large, small):
        if not (folder / "config.json").is_file():
            raise CompressError(f"'{folder}' has no config.json: not a run folder or HF folder.")
    check_models(read_config(large)[0], read_config(small)[0])
    iam_map.check_pair(iam_map.identity(large), iam_map.identity(small), large, small)
    path = Path(map_path) if map_path else iam_map.map_file(large)
    if map_path is None and not path.is_file():
        if log:
            log(f"IAM: no mapping of {large} onto {small} yet; making it ({path})")
        iam_map.save_map(iam_map.build_map(large, small), path)
    mapping = iam_map.read_map(path, large, small)
    chosen = iam_map.select(mapping, layers)
    big, tok = load_mapped(large, chosen, dtype=dtype, device=device, **load_kw)
    little, _ = load(small, dtype=dtype, device=device, **load_kw)
    mapped = {ly: mapping["layer_map"][ly] for ly in chosen}
    heads = {ly: mapping["head_map"][ly] for ly in chosen}
    return IAMModel(big, little, mapped, heads, chunk), tok


class Logits(nn.Module):
    """``model(ids [B, T]).logits``, as transformers' models answer (``eval/perplexity``): the
    pair run over a fresh ``full`` cache. Its ``config`` and ``lm_head`` are the large model's,
    which is what the evaluation reads of a model (widths, vocabulary, head)."""

    def __init__(self, model: IAMModel):
        super().__init__()
        self.model = model

    @property
    def config(self):
        return self.model.large.config

    @property
    def lm_head(self):
        return self.model.large.lm_head

    def __setattr__(self, name, value):  # compress.layers.head.quantize_head swaps the head
        if name == "lm_head":
            self.model.large.lm_head = value
        else:
            super().__setattr__(name, value)

    def forward(self, ids):
        cache = new_cache(self.model, "full", ids.shape[0], ids.shape[1])
        return SimpleNamespace(logits=self.model(ids, cache))


__all__ = ["IAMModel", "Logits", "PairCache", "load_iam"]
