"""Activation-based importance (Minitron: Sreenivas et al. 2024, arXiv 2407.14679), forward passes only.

Calibration batches X ``[B, S]`` run through the model with hooks; no logits are
computed (a hook on the final norm stops the forward). Every width score is the
mean over the sequence and the L2 norm over the batch::

    agg(a) = sqrt( sum_b ( mean_s a[b, s] )^2 )

Only the running sums of squares are kept, so memory holds one batch's
activations of one layer, whatever the number of samples (the batches stream).

- heads, per layer and query head h (o_proj's input, head h's slice)::

      F_head(h)   = agg( ||attn_h(X)[b, s, :]||_2 )
      F_group(g)  = ||( F_head(h) for the query heads h of KV group g )||_2        (GQA)

- MLP neurons, per layer and neuron i (down_proj's input, silu(gate) * up)::

      F_neuron(i) = agg( |act_i| )                       (|.| as NVIDIA ModelOpt's mcore_minitron)

- hidden (embedding) channels j, over the outputs of every hidden-width norm n of every
  layer (``adapter.norms()``: input_layernorm and post_attention_layernorm in the Llama
  family; Gemma 3's four, input / post-attention / pre-feedforward / post-feedforward, whose
  outputs on the attention and MLP sides are what each residual update adds)::

      F_emb(j)    = sum_n agg( |n(X)_j| )

- layers, block importance (1 - cosine between a block's input and output, over all tokens)::

      BI_l        = 1 - mean_{b,s} cos( x_l[b, s], x_{l+1}[b, s] )

- optionally, the perplexity drop when layer l alone is skipped, on the first samples::

      ppl_drop_l  = ppl(model without layer l) - ppl(model)

Scores are saved as safetensors (``save_scores``); ``cached_importance`` keys them by
the weights' sha256 and the calibration settings, so re-pruning to another size
skips the calibration pass.
"""

import hashlib
import json
import logging
import math
import os
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from tqdm import tqdm

from compress.arch.adapters import get_adapter, head_dim
from compress.io.run_folder import weights_sha256

log = logging.getLogger(__name__)

VERSION = 1  # bump when the definitions above change: it invalidates cached scores


class _Stop(Exception):
    pass


def _hidden(x):
    return x[0] if isinstance(x, tuple) else x


@torch.no_grad()
def activation_importance(
    model: nn.Module, tokens: torch.Tensor, batch_size: int = 8, progress: bool = True
) -> dict[str, torch.Tensor]:
    """Width and block scores of ``model`` on ``tokens [n, seqlen]``, streamed in batches.

    Returns float32 tensors: ``heads [L, H]``, ``groups [L, KV]``, ``neurons [L, I]``,
    ``norm_channels [L, N, D]`` (per norm, N = len(adapter.norms())), ``channels [D]`` (their
    sum), ``block [L]``.
    """
    cfg, adapter = model.config, get_adapter(model.config)
    layers = adapter.decoder_layers(model)
    L, H, KV, hd = len(layers), cfg.num_attention_heads, cfg.num_key_value_heads, head_dim(cfg)
    D, Inter = cfg.hidden_size, cfg.intermediate_size
    f64 = dict(dtype=torch.float64)
    norms = adapter.norms()
    sq = {
        "heads": torch.zeros(L, H, **f64),
        "neurons": torch.zeros(L, Inter, **f64),
        "norms": torch.zeros(L, len(norms), D, **f64),
        "bi": torch.zeros(L, **f64),
    }
    n_tokens = [0]

    def sum_sq(acc, per_sample):  # per_sample [B, ...]: sum over the batch of its squares
        acc += per_sample.double().pow(2).sum(0)

    def heads_hook(l):
        def hook(_m, args):
            x = args[0].float()
            sum_sq(sq["heads"][l], x.unflatten(-1, (H, hd)).norm(dim=-1).mean(1))

        return hook

    def neurons_hook(l):
        def hook(_m, args):
            sum_sq(sq["neurons"][l], args[0].float().abs().mean(1))

        return hook

    def norm_hook(l, k):
        def hook(_m, _args, out):
            sum_sq(sq["norms"][l, k], _hidden(out).float().abs().mean(1))

        return hook

    def block_hook(l):
        def hook(_m, args, kwargs, out):
            x = args[0] if args else kwargs["hidden_states"]
            cos = F.cosine_similarity(x.float(), _hidden(out).float(), dim=-1)  # [B, S]
            sq["bi"][l] += (1 - cos).double().sum()
            if l == 0:
                n_tokens[0] += cos.numel()

        return hook

    def stop(_m, _args):
        raise _Stop

    handles = [model.get_submodule(adapter.final_norm).register_forward_pre_hook(stop)]
    for l, layer in enumerate(layers):
        handles += [
            adapter.linear(layer, "o").register_forward_pre_hook(heads_hook(l)),
            adapter.linear(layer, "down").register_forward_pre_hook(neurons_hook(l)),
            *(
                layer.get_submodule(n).register_forward_hook(norm_hook(l, k))
                for k, n in enumerate(norms)
            ),
            layer.register_forward_hook(block_hook(l), with_kwargs=True),
        ]
    try:
        for chunk in tqdm(
            tokens.split(batch_size), desc="importance", unit="batch", disable=not progress
        ):
            try:
                model(chunk, use_cache=False)
            except _Stop:
                pass
    finally:
        for h in handles:
            h.remove()

    heads = sq["heads"].sqrt()
    norm_channels = sq["norms"].sqrt()
    out = {
        "heads": heads,
        "groups": heads.view(L, KV, H // KV).norm(dim=-1),
        "neurons": sq["neurons"].sqrt(),
        "norm_channels": norm_channels,
        "channels": norm_channels.sum((0, 1)),
        "block": sq["bi"] / max(n_tokens[0], 1),
    }
    return {k: v.float() for k, v in out.items()}


@torch.no_grad()
def _nll(model: nn.Module, tokens: torch.Tensor, batch_size: int) -> float:
    total, count = 0.0, 0
    for chunk in tokens.split(batch_size):
        logits = model(chunk, use_cache=False).logits[:, :-1].float()
        total += F.cross_entropy(
            logits.flatten(0, 1), chunk[:, 1:].flatten(), reduction="sum"
        ).item()
        count += chunk[:, 1:].numel()
    return total / count


@torch.no_grad()
def layer_ppl_drop(
    model: nn.Module, tokens: torch.Tensor, batch_size: int = 1, progress: bool = True
) -> torch.Tensor:
    """``[L]``: ppl(model with layer l skipped) - ppl(model) on ``tokens`` (L + 1 full passes)."""
    layers = get_adapter(model.config).decoder_layers(model)
    base = math.exp(_nll(model, tokens, batch_size))
    drops = []
    for layer in tqdm(layers, desc="ppl drop", unit="layer", disable=not progress):

        def identity(_m, args, kwargs, out):
            x = args[0] if args else kwargs["hidden_states"]
            return (x, *out[1:]) if isinstance(out, tuple) else x

        h = layer.register_forward_hook(identity, with_kwargs=True)
        try:
            drops.append(math.exp(_nll(model, tokens, batch_size)) - base)
        finally:
            h.remove()
    return torch.tensor(drops, dtype=torch.float32)


def save_scores(path: Path, scores: dict[str, torch.Tensor], meta: dict) -> None:
    """Write scores + their settings (safetensors metadata ``meta``, JSON), atomically."""
    from safetensors.torch import save_file

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    save_file(
        {k: v.contiguous() for k, v in scores.items()},
        str(tmp),
        metadata={"meta": json.dumps(meta)},
    )
    tmp.replace(path)


def load_scores(path: Path) -> tuple[dict[str, torch.Tensor], dict]:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        meta = json.loads((f.metadata() or {}).get("meta", "{}"))
        return {k: f.get_tensor(k) for k in f.keys()}, meta


def scores_key(weights_sha: str, settings: dict) -> str:
    """File stem of cached scores: the weights and every setting that changes them."""
    blob = json.dumps({"weights": weights_sha, "version": VERSION, **settings}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:32]


def cached_importance(
    model: nn.Module,
    tokens_fn,
    settings: dict,
    cache: Path | None,
    batch_size: int = 8,
    ppl_samples: int = 0,
) -> tuple[dict, Path | None]:
    """Scores of ``model`` from ``cache`` (a folder) or computed on ``tokens_fn()`` and saved there.

    ``settings`` (calibration source digest, samples, seqlen, seed) and the weights'
    sha256 form the key. With ``ppl_samples`` > 0, ``ppl_drop`` is added (and cached).
    """

    settings = {**settings, "ppl_samples": int(ppl_samples)}
    path = None
    if cache is not None:
        path = Path(cache) / f"{scores_key(weights_sha256(model), settings)}.safetensors"
        if path.is_file():
            log.info("importance scores from cache: %s", path)
            return load_scores(path)[0], path
    tokens = tokens_fn()
    scores = activation_importance(model, tokens, batch_size)
    if ppl_samples:
        scores["ppl_drop"] = layer_ppl_drop(model, tokens[:ppl_samples])
    if path is not None:
        save_scores(path, scores, settings)
    return scores, path
