"""Calibration of a mixture-of-experts layer's MLPs, shared by AWQ and GPTQ.

A sparse layer's gated MLPs are each expert (``compress.layers.experts.LinearExperts``: one
linear per projection, label ``"e"``) and the shared expert (``"shared"``); a dense layer has
one (``"dense"``). **All-experts calibration** (``experts: all``, the default of both stages):
every expert's statistics use every calibration token, its down projection's input
``act(gate_e x) * up_e x`` computed for all of them, while the layer's output, the next
layer's input, stays the routed one. ``experts: routed`` uses the tokens routed to the expert,
and an expert routed fewer than ``expert_min_tokens`` tokens falls back to all tokens
(recorded as a fallback), so no expert is left without statistics.
"""

import torch
from torch import nn

from compress.arch.adapters import Adapter
from compress.errors import CompressError
from compress.layers.experts import LinearExperts

MODES = ("all", "routed")


def gated_parts(layer: nn.Module, adapter: Adapter) -> list[tuple[str, nn.Module, object]]:
    """``(label, gated MLP, its activation)`` of a mixture-of-experts family's layer: each
    expert (label ``e``) and the shared expert ("shared") of a sparse layer, or the dense MLP
    ("dense"). A gated MLP names its linears ``names`` (experts) or gate/up/down_proj."""
    mlp = layer.get_submodule(adapter.mlp)
    experts = getattr(mlp, "experts", None)
    if not isinstance(experts, LinearExperts):
        return [("dense", mlp, mlp.act_fn)]
    parts = [(str(e), experts[e], experts.act_fn) for e in range(experts.n_experts)]
    shared = getattr(mlp, adapter.shared_name, None)
    return parts + ([("shared", shared, shared.act_fn)] if shared is not None else [])


def linear_names(gated: nn.Module) -> tuple:
    """A gated MLP's (gate, up, down) linear names."""
    return getattr(gated, "names", ("gate_proj", "up_proj", "down_proj"))


def down_input(gated: nn.Module, act, x: torch.Tensor) -> torch.Tensor:
    """``act(gate(x)) * up(x)``: what a gated MLP's down projection reads, for rows ``x``."""
    g, u, _ = linear_names(gated)
    return act(getattr(gated, g)(x)) * getattr(gated, u)(x)


@torch.no_grad()
def moe_layer_inputs(layer, adapter, x, kwargs, batch):
    """``(feats, routed)``: the inputs of q and o (where the entry lists attention roles) and of
    the MLP (``mlp_in``) for every token, and the experts each token was routed to
    (``[tokens, k]``, None in a dense layer)."""
    roles = [r for r in ("q", "o") if r in dict(adapter.linears)]
    feats = {r: [] for r in (*roles, "mlp_in")}
    routed = []
    mlp = layer.get_submodule(adapter.mlp)

    def grab(key):
        return lambda _m, args: feats[key].append(args[0])

    hooks = [adapter.linear(layer, r).register_forward_pre_hook(grab(r)) for r in roles]
    hooks.append(mlp.register_forward_pre_hook(grab("mlp_in")))
    if isinstance(getattr(mlp, "experts", None), LinearExperts):
        hooks.append(mlp.experts.register_forward_pre_hook(lambda _m, args: routed.append(args[1])))
    try:
        for chunk in x.split(batch):
            layer(chunk, **kwargs)
    finally:
        for h in hooks:
            h.remove()
    return {k: torch.cat(v) for k, v in feats.items()}, torch.cat(routed) if routed else None


def routed_counts(layer, adapter, routed) -> list[int] | None:
    """Tokens routed to each expert of the layer (None in a dense layer)."""
    if routed is None:
        return None
    n = layer.get_submodule(adapter.mlp).experts.n_experts
    return torch.bincount(routed.flatten(), minlength=n).tolist()


def expert_rows(cfg, label: str, routed, record: dict):
    """The calibration rows part ``label`` computes its statistics on (module docstring): None
    (every row) with ``experts: all``, for the shared expert and the dense MLP, and for a routed
    expert below ``expert_min_tokens`` (recorded in ``record["fallback"]``)."""
    if routed is None or not label.isdigit() or cfg.get("experts", "all") == "all":
        return None
    rows = (routed == int(label)).any(-1).nonzero().flatten()
    if len(rows) < int(cfg.get("expert_min_tokens", 1)):
        record.setdefault("fallback", set()).add(int(label))
        return None
    return rows


def report(stage: str, experts: dict) -> dict:
    """The report's ``{stage}_experts_routed`` (each sparse layer's routed count per expert) and
    ``{stage}_experts_fallback`` (the experts that fell back to all tokens) from the per-layer
    records :func:`routed_counts` and :func:`expert_rows` filled; empty for a dense model."""
    if not experts:
        return {}
    routed = {i: e["routed"] for i, e in experts.items() if "routed" in e}
    fallback = {i: sorted(e["fallback"]) for i, e in experts.items() if e.get("fallback")}
    return {f"{stage}_experts_routed": routed, f"{stage}_experts_fallback": fallback}


def check(c, stage: str) -> None:
    """Refuse ``{stage}.experts`` and ``{stage}.expert_min_tokens`` that are not settings."""
    if c.get("experts", "all") not in MODES:
        raise CompressError(
            f"{stage}.experts={c.get('experts')!r}: all (every expert's statistics on every "
            f"calibration token, the default) or routed (on the tokens routed to it)."
        )
    m = c.get("expert_min_tokens", 1)
    if not (isinstance(m, int) and not isinstance(m, bool) and m >= 0):
        raise CompressError(
            f"{stage}.expert_min_tokens={m!r}: an integer >= 0 (with {stage}.experts=routed, "
            f"an expert routed fewer tokens uses all of them)."
        )
