"""Layer-local fitting of converted attention: the attention-transfer stage of LoLCATs (Zhang et
al. 2025, arXiv 2410.10254, stage 1), before any end-to-end training.

For each group of converted layers (one layer; a CLA group of ``share`` layers, which attend with
the K/V of its first), given the *source's own* attention inputs ``x_l = input_norm_l(h_l)`` on
calibration text and the source layer's attention output ``y_l = attn_l(x_l)``::

    min_theta  sum_{l in group}  || attn'_l(x_l; theta) - y_l ||^2 / || y_l ||^2

theta: every parameter of the group's converted attention blocks (q, k, v, o or the latent
projections), by Adam on minibatches of ``batch`` sequences, ``steps`` steps a group with a cosine
decay of ``lr``. The last minibatch of calibration sequences is held out: the relative error
``||attn' - y|| / ||y||`` on it before and after is ``report.json``'s ``fit``, and a group whose
held-out error does not fall keeps its initialisation.

The source's hidden states ``h_l`` advance through the source's own decoder layers, one layer at
a time, so memory holds one layer's (one group's) ``x`` and ``y`` over the calibration set: as
for calibration, bounded by the set and not by the depth. The layers' other inputs (RoPE
tables, masks) are each model's own, recorded once from one batch of the same shape.
"""

import logging
import math
import time

import torch
from tqdm import tqdm

from compress.arch.adapters import get_adapter
from compress.errors import CompressError

log = logging.getLogger(__name__)


class _Stop(Exception):
    pass


def _hidden_of(args, kwargs) -> torch.Tensor:
    return kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]


def _rest(args, kwargs) -> tuple[tuple, dict]:
    """The call's arguments without its hidden states (every other input depends on the batch's
    shape only: positions, RoPE tables, masks)."""
    if "hidden_states" in kwargs:
        return args, {k: v for k, v in kwargs.items() if k != "hidden_states"}
    return args[1:], dict(kwargs)


@torch.no_grad()
def _record_calls(model, modules, ids: torch.Tensor) -> list[tuple[tuple, dict]]:
    """Each module's call arguments (less its hidden states) when ``model`` runs on ``ids``."""
    calls = [None] * len(modules)

    def hook(i):
        def pre(_m, args, kwargs):
            calls[i] = _rest(args, kwargs)

        return pre

    handles = [
        m.register_forward_pre_hook(hook(i), with_kwargs=True) for i, m in enumerate(modules)
    ]
    try:
        model(ids, use_cache=False)
    finally:
        for h in handles:
            h.remove()
    return calls


@torch.no_grad()
def _embedded(model, layer0, ids: torch.Tensor) -> torch.Tensor:
    """The hidden states entering the first decoder layer (the model's own embedding, scale
    included), without running the layers."""
    kept = []

    def pre(_m, args, kwargs):
        kept.append(_hidden_of(args, kwargs))
        raise _Stop

    h = layer0.register_forward_pre_hook(pre, with_kwargs=True)
    try:
        model(ids, use_cache=False)
    except _Stop:
        pass
    finally:
        h.remove()
    return kept[0]


def groups_of(config) -> list[list[int]]:
    """The layers fitted together: a CLA group shares its first layer's K/V, others stand alone."""
    n, share = config.num_hidden_layers, int(getattr(config, "cla_share", 1) or 1)
    return [list(range(f, min(n, f + share))) for f in range(0, n, share)]


def _relative(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``||out - y||^2 / ||y||^2``, the loss."""
    return (out - y).pow(2).sum() / y.pow(2).sum().clamp_min(1e-30)


def fit_attention(
    source,
    model,
    tokens: torch.Tensor,
    steps: int = 100,
    lr: float = 1e-3,
    batch: int = 4,
) -> dict:
    """Fit ``model``'s attention blocks (in place) to ``source``'s layer by layer on ``tokens
    [samples, seqlen]`` (the module docstring). Returns the per-group held-out relative errors
    before and after, and the seconds taken."""
    if source.config.num_hidden_layers != model.config.num_hidden_layers:
        raise CompressError(
            f"fit: the source has {source.config.num_hidden_layers} layers and the converted "
            f"model {model.config.num_hidden_layers}; layer-local fitting pairs them one to one."
        )
    if steps < 0 or lr <= 0 or batch < 1:
        raise CompressError(
            f"fit.steps={steps}, fit.lr={lr}, fit.batch={batch}: steps >= 0, lr > 0, batch >= 1."
        )
    t0 = time.time()
    trainable = {p: p.requires_grad for p in model.parameters()}  # given back at the end
    source.eval().requires_grad_(False)
    model.eval().requires_grad_(False)
    dtype = next(model.parameters()).dtype
    src_layers = get_adapter(source.config).decoder_layers(source)
    our_layers = get_adapter(model.config).decoder_layers(model)
    src_attn = [ly.get_submodule(get_adapter(source.config).attn) for ly in src_layers]
    our_attn = [ly.get_submodule(get_adapter(model.config).attn) for ly in our_layers]
    if tokens.shape[0] < 2:
        raise CompressError(
            f"fit: {tokens.shape[0]} calibration sequence(s); the fitting holds one batch out to "
            f"measure itself and trains on the rest, so it needs 2 or more. Raise calib.samples."
        )
    batch = min(batch, tokens.shape[0] // 2)
    chunks = [tokens[i : i + batch] for i in range(0, tokens.shape[0] - batch + 1, batch)]
    held = len(chunks) - 1  # the last batch; the others train
    layer_calls = _record_calls(source, src_layers, chunks[0])
    our_calls = _record_calls(model, our_attn, chunks[0])
    hidden = [_embedded(source, src_layers[0], c) for c in chunks]

    report = {"groups": [], "before": [], "after": [], "steps": steps, "lr": lr, "batch": batch}
    bar = tqdm(groups_of(model.config), desc="fit attention", unit="group")
    for group in bar:
        xs, ys = {}, {}
        for layer in group:  # the source's inputs and outputs of each layer, then its next input
            xs[layer], ys[layer] = [], []
            kept = {}

            def grab(_m, args, kwargs, out, kept=kept):
                kept["x"], kept["y"] = _hidden_of(args, kwargs), out[0]

            h = src_attn[layer].register_forward_hook(grab, with_kwargs=True)
            try:
                with torch.no_grad():
                    for i, hb in enumerate(hidden):
                        args, kwargs = layer_calls[layer]
                        out = src_layers[layer](hb, *args, **kwargs)
                        hidden[i] = out[0] if isinstance(out, tuple) else out
                        xs[layer].append(kept["x"].to(dtype))
                        ys[layer].append(kept["y"].to(dtype))
            finally:
                h.remove()

        def loss_of(i: int) -> torch.Tensor:
            total = 0.0
            for layer in group:  # in order: a CLA group's first layer makes the shared K/V
                args, kwargs = our_calls[layer]
                out = our_attn[layer](xs[layer][i], *args, **kwargs)[0]
                total = total + _relative(out, ys[layer][i])
            return total / len(group)

        params = [p for layer in group for p in our_attn[layer].parameters()]
        kept_state = [p.detach().clone() for p in params]
        with torch.no_grad():
            before = loss_of(held).item() ** 0.5
        if steps:
            for p in params:
                p.requires_grad_(True)
            opt = torch.optim.Adam(params, lr=lr)
            for s in range(steps):
                for g in opt.param_groups:
                    g["lr"] = lr * 0.5 * (1 + math.cos(math.pi * s / steps))
                loss = loss_of(s % held)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
            for p in params:
                p.requires_grad_(False)
            with torch.no_grad():
                after = loss_of(held).item() ** 0.5
                if not after < before:  # no better than where it started: keep the start
                    for p, k in zip(params, kept_state, strict=True):
                        p.copy_(k)
                    after = before
        else:
            after = before
        report["groups"].append(group)
        report["before"].append(round(before, 5))
        report["after"].append(round(after, 5))
        bar.set_postfix(before=f"{before:.3f}", after=f"{after:.3f}")
        log.debug("fit: layers %s relative error %.4f -> %.4f", group, before, after)
    for p, flag in trainable.items():
        p.requires_grad_(flag)
    report["seconds"] = round(time.time() - t0, 1)
    return report


__all__ = ["fit_attention", "groups_of"]
