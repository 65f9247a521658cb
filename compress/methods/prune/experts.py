"""Minitron for mixture-of-experts models: expert pruning by REAP saliency, then width pruning of
each expert (Sreenivas et al. 2024, arXiv 2407.14679, with experts for the MLP).

Calibration tokens run through transformers' model; a hook on each sparse layer's experts
module reads its input x, the routed experts e_j and their router weights g_j. Expert e of a
layer scores REAP's saliency (Lasby et al. 2025, arXiv 2510.13999, "router-weighted expert
activation pruning") over the tokens X_e routed to it::

    S_e = (1 / |X_e|) sum_{x in X_e} g_e(x) ||f_e(x)||_2      f_e(x) = down_e(act(gate_e x) * up_e x)

(0 for an expert no token reaches), and each of its intermediate channels i Minitron's neuron
importance over the same tokens::

    F_e(i) = (1 / |X_e|) sum_{x in X_e} |act(gate_e x)_i (up_e x)_i|

A shared expert (DeepSeek V3's, whose width is n_shared_experts x the expert width) scores its
channels the same way over every token. Each layer keeps its ``keep`` experts of highest S_e, in
their order (a grouped router, DeepSeek V3's: the keep / n_group best of each group, so every
expert stays in its group): the router's rows (and DeepSeek's correction bias) of the others are dropped, so
their probability mass goes to the kept ones. With ``intermediate_size`` w, every kept expert
keeps its w channels of highest F_e (gate and up rows, down columns), and a shared expert its
n_shared_experts x w best. The config's expert count and expert width change; everything else is
copied. Distillation (``compress.methods.distill``) follows in the recipe.
"""

import copy

import torch
import torch.nn.functional as F
from torch import nn
from tqdm import tqdm

from compress.arch.moe import EXPERTS
from compress.arch.spec import spec_of
from compress.errors import CompressError


def _counts(value, total: int, what: str, low: int) -> int:
    """``value`` (a count, or a fraction of ``total`` when below 1) as a count in [low, total]."""
    if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
        raise CompressError(
            f"prune.experts.{what}={value!r}: give a count (an integer) or a fraction of the "
            f"source's {total} (a number below 1)."
        )
    n = round(value * total) if value < 1 else value
    if n != int(n) or not low <= n <= total:
        raise CompressError(
            f"prune.experts.{what}={value!r} gives {n}; it must be a whole number from {low} to "
            f"the source's {total}."
        )
    return int(n)


def target(hf_config, experts: dict) -> dict:
    """``{"keep": experts per sparse layer, "width": each expert's width}`` asked by
    ``prune.experts`` (null: the source's), checked against the spec before any weight is read."""
    spec = spec_of(hf_config)
    moe, a = spec.moe, spec.adapter
    if moe is None:
        raise CompressError(
            f"prune.experts is set, but '{hf_config.model_type}' has no experts; use "
            f"prune.export or prune.target_params for a dense model."
        )
    if a.expert_layout != "fused":
        raise CompressError(
            f"prune.experts on '{hf_config.model_type}': its experts (transposed, with biases) "
            f"are not pruned yet; use recipe=fp."
        )
    keep, width = experts.get("keep"), experts.get("intermediate_size")
    keep = moe.n_experts if keep is None else _counts(keep, moe.n_experts, "keep", moe.top_k)
    width = (
        moe.intermediate_size
        if width is None
        else _counts(width, moe.intermediate_size, "intermediate_size", 1)
    )
    if moe.n_group > 1 and (keep % moe.n_group or keep // moe.n_group < 2):
        raise CompressError(
            f"prune.experts.keep={keep}: '{hf_config.model_type}' routes among n_group="
            f"{moe.n_group} groups, so each layer must keep a multiple of {moe.n_group} experts, "
            f"at least 2 per group."
        )
    if moe.n_group > 1 and moe.top_k > moe.topk_group * (keep // moe.n_group):
        raise CompressError(
            f"prune.experts.keep={keep}: top-{moe.top_k} routing among topk_group="
            f"{moe.topk_group} groups of {keep // moe.n_group} experts is impossible; keep more."
        )
    return {"keep": keep, "width": width}


def _routed(args, kwargs):
    """``(x [N, H], e [N, k], g [N, k])`` of a call of transformers' experts module."""
    names = ("hidden_states", "top_k_index", "top_k_weights")
    got = list(args) + [kwargs[n] for n in names[len(args) :] if n in kwargs]
    if len(got) < 3:
        raise CompressError(
            "the experts module was called without (hidden_states, indices, weights); this "
            "transformers version's MoE layer is not one compress's expert pruning reads."
        )
    return got[0], got[1], got[2]


@torch.no_grad()
def expert_scores(
    model: nn.Module, tokens: torch.Tensor, batch_size: int = 8, progress: bool = True
) -> dict:
    """REAP saliency and channel importance (module docstring) of transformers' ``model`` on
    ``tokens [n, seqlen]``: ``{layer: {"saliency": [E], "channels": [E, I], "routed": [E],
    "shared": [width] or None}}``, float64, streamed in batches."""
    spec = spec_of(model.config)
    a = spec.adapter
    layers = a.decoder_layers(model)
    E, inter = spec.moe.n_experts, spec.moe.intermediate_size
    acc, handles = {}, []

    def experts_hook(index):
        def hook(module, args, kwargs):
            x, e, g = _routed(args, kwargs)
            s = acc[index]
            x = x.reshape(-1, x.shape[-1])
            e, g = e.reshape(x.shape[0], -1), g.reshape(x.shape[0], -1)
            for expert in e.unique().tolist():
                rows, slot = (e == expert).nonzero(as_tuple=True)
                gate, up = F.linear(x[rows], module.gate_up_proj[expert]).chunk(2, -1)
                h = module.act_fn(gate) * up
                y = F.linear(h, module.down_proj[expert])
                w = g[rows, slot].double()
                s["saliency"][expert] += (w * y.double().norm(dim=-1)).sum()
                s["channels"][expert] += h.double().abs().sum(0)
                s["routed"][expert] += len(rows)

        return hook

    def shared_hook(index):
        def hook(_m, args):
            h = args[0].reshape(-1, args[0].shape[-1]).double()
            acc[index]["shared"] += h.abs().sum(0)
            acc[index]["tokens"] += h.shape[0]

        return hook

    for ls in spec.layers:
        if ls.mlp != EXPERTS:
            continue
        mlp = layers[ls.index].get_submodule(a.mlp)
        s = {k: torch.zeros(E, dtype=torch.float64) for k in ("saliency", "routed")}
        s.update(channels=torch.zeros(E, inter, dtype=torch.float64), shared=None, tokens=0)
        acc[ls.index] = s
        handles.append(
            mlp.experts.register_forward_pre_hook(experts_hook(ls.index), with_kwargs=True)
        )
        shared = getattr(mlp, a.shared_name, None)
        if shared is not None and a.shared_expert == "plain":  # its width follows the experts'
            s["shared"] = torch.zeros(shared.down_proj.in_features, dtype=torch.float64)
            handles.append(shared.down_proj.register_forward_pre_hook(shared_hook(ls.index)))
    body = model.get_submodule(a.layers.rpartition(".")[0])  # the model without its head
    try:
        for chunk in tqdm(
            tokens.split(batch_size), desc="expert saliency", unit="batch", disable=not progress
        ):
            body(chunk, use_cache=False)
    finally:
        for h in handles:
            h.remove()
    out = {}
    for index, s in acc.items():
        n = s["routed"].clamp(min=1)
        out[index] = {
            "saliency": s["saliency"] / n,
            "channels": s["channels"] / n[:, None],
            "routed": s["routed"],
            "shared": None if s["shared"] is None else s["shared"] / max(s["tokens"], 1),
        }
    return out


def _top(score: torch.Tensor, k: int) -> torch.Tensor:
    """The indices of the k highest scores, in ascending order (ties: the lower index)."""
    order = torch.argsort(-score, stable=True)[:k]
    return order.sort().values


def kept(scores: dict, keep: int, width: int, groups: int = 1) -> dict:
    """``{layer: {"experts": [keep], "channels": [keep, width], "shared": [n] or None}}``; with
    ``groups`` > 1 the best keep / groups of each group of experts."""
    out = {}
    for index, s in scores.items():
        per = s["saliency"].view(groups, -1)
        experts = torch.cat([_top(g, keep // groups) + i * per.shape[1] for i, g in enumerate(per)])
        channels = torch.stack([_top(s["channels"][e], width) for e in experts.tolist()])
        shared = None
        if s["shared"] is not None:
            ratio = s["shared"].numel() // s["channels"].shape[1]  # n_shared_experts
            shared = _top(s["shared"], ratio * width) if width < s["channels"].shape[1] else None
        out[index] = {"experts": experts, "channels": channels, "shared": shared}
    return out


def pruned_config(config, keep: int, width: int):
    a = spec_of(config).adapter
    new = copy.deepcopy(config)
    setattr(new, a.experts_field, keep)
    setattr(new, a.expert_size_field, width)
    return new


@torch.no_grad()
def prune_experts(model: nn.Module, keep_idx: dict, keep: int, width: int) -> nn.Module:
    """A new transformers model with ``keep`` experts of ``width`` per sparse layer, its weights
    sliced from ``model`` by :func:`kept`'s indices."""
    from transformers import AutoModelForCausalLM

    spec = spec_of(model.config)
    a = spec.adapter
    new = AutoModelForCausalLM.from_config(
        pruned_config(model.config, keep, width), dtype=next(model.parameters()).dtype
    )
    sd = model.state_dict()
    inter = spec.moe.intermediate_size
    for index, k in keep_idx.items():
        p = f"{a.layers}.{index}.{a.mlp}"
        e, ch = k["experts"], k["channels"]
        gate_up = sd[f"{p}.experts.gate_up_proj"][e]  # [keep, 2I, H]
        rows = torch.cat([ch, ch + inter], 1)  # each expert's gate rows, then its up rows
        sd[f"{p}.experts.gate_up_proj"] = gate_up.gather(
            1, rows[..., None].expand(-1, -1, gate_up.shape[-1])
        )
        down = sd[f"{p}.experts.down_proj"][e]  # [keep, H, I]
        sd[f"{p}.experts.down_proj"] = down.gather(2, ch[:, None].expand(-1, down.shape[1], -1))
        for name in ("gate.weight", "gate.e_score_correction_bias"):
            if f"{p}.{name}" in sd:
                sd[f"{p}.{name}"] = sd[f"{p}.{name}"][e]
        if k["shared"] is not None:
            s = k["shared"]
            for name, dim in (("gate_proj", 0), ("up_proj", 0), ("down_proj", 1)):
                key = f"{p}.{a.shared_name}.{name}.weight"
                sd[key] = sd[key].index_select(dim, s)
    want = new.state_dict()
    for name, t in sd.items():
        if name in want and t.shape != want[name].shape:
            raise CompressError(
                f"cannot slice '{name}' {tuple(t.shape)} to {tuple(want[name].shape)}: compress's "
                f"expert pruning does not know this tensor's role."
            )
    new.load_state_dict({n: t.contiguous() for n, t in sd.items() if n in want}, strict=True)
    return new.eval()
