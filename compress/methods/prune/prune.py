"""Slice a Llama-family model to smaller widths and fewer layers, from importance scores.

Sizes use the HF config's names (NVIDIA ModelOpt's mcore_minitron ``export_config``
names in brackets)::

    hidden_size          [hidden_size]          embedding channels, top-k by F_emb, shared by every layer
    intermediate_size    [ffn_hidden_size]      MLP neurons, top-k by F_neuron, per layer
    num_key_value_heads  [num_query_groups]     whole KV groups, top-k by F_group, per layer
    num_attention_heads  [num_attention_heads]  query heads: the same count per kept group, top-k by F_head
    num_hidden_layers    [num_layers]           layers, top-k by block importance (or ppl drop)

Kept units stay in their original order. Weights are sliced, never re-initialised;
``head_dim`` is kept (written into config.json), RMSNorm weights are sliced with the
hidden channels, tied embeddings stay tied. Per family, from the architecture spec:

- every hidden-width norm of a layer is sliced (``adapter.norms()``: Gemma 3's four);
  per-head q/k norms (Qwen3, Gemma 3) are head_dim wide and shared by the heads, so pruning
  heads or hidden channels leaves them whole;
- Gemma's embedding scale sqrt(hidden_size) is recomputed by transformers from the pruned
  config, so the kept embedding rows are multiplied by sqrt(D0 / D1) (the residual stream
  keeps its scale) and, the head being tied, the final norm's (1 + w) divided by it;
- depth pruning keeps the kept layers' ``layer_types`` (Gemma 3's local/global pattern,
  Qwen2's windowed layers), so each kept layer keeps its window and RoPE theta.

The result is a homogeneous HF model of the same class, so ``AutoModelForCausalLM.from_pretrained`` loads the saved folder.
transformers' ``LlamaConfig`` (5.x) refuses a hidden_size that is not a multiple of
num_attention_heads, even with an explicit head_dim, so for llama that is a rule here
too (``Layout.hidden_per_head``); mistral and qwen2 do not have it.

Parameter count (no biases; biases add their output sizes), with hd = head_dim::

    P = L * (2*D*H*hd + 2*D*KV*hd + 3*D*I + N*D + 2*hd*qk) + V*D*(1 if tied else 2) + D

with N the hidden-width norms per layer (2; Gemma 3: 4) and qk 1 where q/k are normalized.

**Budget solver** (``solve_budget``), over the free width axes (default hidden_size and
intermediate_size; the head axes if listed):

1. Candidates: every valid (KV groups, heads per group) pair of the free head axes; every
   hidden_size that is a multiple of ``round`` (and of the head count where the config
   demands it); for each, the largest intermediate_size, a multiple of ``round``, with
   P <= target (P is linear in it).
2. Keep the candidates within ``tolerance`` (3%) below the target (if none, the largest).
3. Among them, pick the most balanced: the largest smallest keep ratio (size / source
   size) over the free axes; ties go to the larger P.
"""

import copy
import math
from dataclasses import dataclass

import torch
from torch import nn

from compress.arch.adapters import get_adapter, head_dim
from compress.arch.spec import model_spec
from compress.errors import CompressError

AXES = (
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "num_hidden_layers",
)
WIDTH_AXES = AXES[:4]


def sizes_of(config) -> dict[str, int]:
    return {a: int(getattr(config, a)) for a in AXES}


@dataclass(frozen=True)
class Layout:
    """What the parameter count and the validity rules need besides the sizes."""

    vocab: int
    head_dim: int
    tied: bool
    bias: tuple = ()  # roles with a bias, e.g. ("q", "k", "v") for qwen2
    hidden_per_head: bool = True  # the config demands hidden_size % num_attention_heads == 0
    norms: int = 2  # hidden-width norms per layer (adapter.norms(): 4 for Gemma 3)
    qk_norm: bool = False  # per-head q/k norms of width head_dim (Qwen3, Gemma 3)


def hidden_must_divide(config) -> bool:
    """Whether the config class refuses hidden_size % num_attention_heads != 0 (LlamaConfig does)."""
    probe = dict(
        config.to_dict(), hidden_size=config.num_attention_heads * 8 + 1, head_dim=head_dim(config)
    )
    try:
        type(config)(**probe)
    except Exception:  # noqa: BLE001 - transformers raises several validation types
        return True
    return False


def layout_of(model: nn.Module) -> Layout:
    """The model's layout; refuses layers whose parameters the formula does not cover."""
    cfg, adapter = model.config, get_adapter(model.config)
    spec = model_spec(model)
    layer = adapter.decoder_layers(model)[0]
    bias = tuple(r for r, _ in adapter.linears if adapter.linear(layer, r).bias is not None)
    lay = Layout(
        cfg.vocab_size,
        head_dim(cfg),
        bool(getattr(cfg, "tie_word_embeddings", False)),
        bias,
        hidden_must_divide(cfg),
        len(adapter.norms()),
        spec.qk_norm,
    )
    actual = sum(p.numel() for p in model.parameters())  # parameters() yields shared tensors once
    if param_count(lay, sizes_of(cfg)) != actual:
        raise CompressError(
            f"the '{cfg.model_type}' model has {actual:,} parameters, but the pruning formula for the "
            f"Llama layout gives {param_count(lay, sizes_of(cfg)):,}: its layers hold parameters "
            f"compress/prune does not know how to slice. Extend compress/methods/prune/prune.py for it."
        )
    return lay


def param_count(lay: Layout, s: dict) -> int:
    D, Inter, H, KV, L = (s[a] for a in AXES)
    hd = lay.head_dim
    out = {"q": H * hd, "k": KV * hd, "v": KV * hd, "o": D, "gate": Inter, "up": Inter, "down": D}
    layer = 2 * D * H * hd + 2 * D * KV * hd + 3 * D * Inter + lay.norms * D
    layer += sum(out[r] for r in lay.bias) + (2 * hd if lay.qk_norm else 0)
    return L * layer + lay.vocab * D * (1 if lay.tied else 2) + D


# ---- validity -------------------------------------------------------------------------------


def _near(value: int, valid: list[int]) -> str:
    lo = [v for v in valid if v <= value]
    hi = [v for v in valid if v >= value]
    near = sorted({*(lo[-1:]), *(hi[:1])})
    return " or ".join(str(v) for v in near)


def check_sizes(orig: dict, s: dict, hidden_per_head: bool = True) -> None:
    """Refuse sizes the source cannot be sliced to, naming the nearest valid ones."""
    for a in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_key_value_heads"):
        if not 1 <= s[a] <= orig[a]:
            raise CompressError(
                f"prune size {a}={s[a]} is out of range: the source has {a}={orig[a]}; "
                f"valid sizes are 1..{orig[a]} (nearest: {_near(s[a], list(range(1, orig[a] + 1)))})."
            )
    H0, KV0 = orig["num_attention_heads"], orig["num_key_value_heads"]
    H, KV = s["num_attention_heads"], s["num_key_value_heads"]
    rep0 = H0 // KV0
    valid = [KV * k for k in range(1, rep0 + 1)]
    if H not in valid:
        raise CompressError(
            f"prune size num_attention_heads={H} cannot be met with num_key_value_heads={KV}: every KV group "
            f"keeps the same number of query heads (1..{rep0}, as the source has {H0} heads in {KV0} groups), "
            f"so the valid head counts are {', '.join(map(str, valid))}; nearest: {_near(H, valid)}. "
            f"Or change num_key_value_heads (1..{KV0})."
        )
    D = s["hidden_size"]
    if hidden_per_head and D % H:
        heads = sorted(
            {kv * k for kv in range(1, KV0 + 1) for k in range(1, rep0 + 1) if D % (kv * k) == 0}
        )
        raise CompressError(
            f"prune size hidden_size={D} is not a multiple of num_attention_heads={H}, which transformers' "
            f"config for this model refuses (even with head_dim kept). Nearest valid hidden_size for {H} heads: "
            f"{_near(D, list(range(H, orig['hidden_size'] + 1, H)))}; head counts that divide {D}: "
            f"{', '.join(map(str, heads))}."
        )


# ---- the budget solver ----------------------------------------------------------------------


def resolve_target(target: float, source_params: int) -> int:
    """``target_params``: a fraction of the source (<= 1) or an absolute count (> 1)."""
    if target <= 0:
        raise CompressError(
            f"prune.target_params={target} must be positive: a fraction of the source's "
            f"parameters (e.g. 0.7) or an absolute count (e.g. 95e6)."
        )
    return int(round(target * source_params)) if target <= 1 else int(target)


def _head_options(orig: dict, fixed: dict, free: list[str]) -> list[tuple[int, int]]:
    """(num_attention_heads, num_key_value_heads) pairs the free/fixed head axes allow."""
    H0, KV0 = orig["num_attention_heads"], orig["num_key_value_heads"]
    rep0 = H0 // KV0
    kvs = (
        range(1, KV0 + 1)
        if "num_key_value_heads" in free
        else [fixed.get("num_key_value_heads", KV0)]
    )
    out = []
    for kv in kvs:
        if "num_attention_heads" in free:
            out += [(kv * k, kv) for k in range(1, rep0 + 1)]
        elif "num_attention_heads" in fixed:
            h = fixed["num_attention_heads"]
            if h % kv == 0 and h // kv <= rep0:
                out.append((h, kv))
        else:  # keep the heads per group
            out.append((kv * rep0, kv))
    return out


def _candidates(lay: Layout, orig: dict, target: int, fixed: dict, free: list[str], step: int):
    """Every candidate of the solver, with intermediate_size as large as the budget allows."""
    base = {**orig, **fixed}
    for H, KV in _head_options(orig, fixed, free):
        if "hidden_size" in free:
            hstep = math.lcm(step, H) if lay.hidden_per_head else step
            hiddens = list(range(hstep, orig["hidden_size"] + 1, hstep))
            if orig["hidden_size"] not in hiddens and not (
                lay.hidden_per_head and orig["hidden_size"] % H
            ):
                hiddens.append(orig["hidden_size"])
        else:
            hiddens = [base["hidden_size"]]
        for D in hiddens:
            s = {**base, "hidden_size": D, "num_attention_heads": H, "num_key_value_heads": KV}
            if lay.hidden_per_head and D % H:
                continue
            if "intermediate_size" in free:
                I0 = orig["intermediate_size"]
                p0 = param_count(lay, {**s, "intermediate_size": 0})
                per = param_count(lay, {**s, "intermediate_size": 1}) - p0
                fit = (target - p0) // per
                s["intermediate_size"] = I0 if fit >= I0 else max(min(step, I0), fit // step * step)
            yield s


def solve_budget(
    lay: Layout, orig: dict, target: int, fixed: dict, axes, step: int = 64, tolerance: float = 0.03
) -> dict:
    """Sizes with ``param_count <= target`` over the ``axes`` not in ``fixed`` (see the module doc)."""
    free = [a for a in axes if a not in fixed]
    bad = [a for a in free if a not in WIDTH_AXES]
    if bad:
        raise CompressError(
            f"prune.axes may list {', '.join(WIDTH_AXES)}; got {bad}. Depth is set "
            f"explicitly with prune.export.num_hidden_layers."
        )
    if not free:
        raise CompressError(
            "prune.target_params needs at least one free width axis (prune.axes), but every "
            "axis has an explicit size in prune.export."
        )
    full = {**orig, **fixed}
    if param_count(lay, full) <= target:
        return full
    cands = [(param_count(lay, s), s) for s in _candidates(lay, orig, target, fixed, free, step)]
    fits = [(p, s) for p, s in cands if p <= target]
    if not cands:
        raise CompressError(
            f"no head counts fit prune.export {fixed} with the free axes {free}; see the "
            f"valid head counts in compress/methods/prune/prune.py check_sizes."
        )
    if not fits:
        p, s = min(cands, key=lambda c: c[0])
        per_head = " (hidden_size also a multiple of the head count)" if lay.hidden_per_head else ""
        sizes = ", ".join(f"{a}={s[a]}" for a in free)
        raise CompressError(
            f"prune.target_params asks for {target:,} parameters, below the smallest model the width axes "
            f"{free} reach in steps of {step}{per_head}: "
            f"{p:,} parameters ({sizes}). Nearest valid target: {p:,}; "
            f"or add axes to prune.axes, lower prune.round, or remove layers (prune.export.num_hidden_layers)."
        )
    best = max(p for p, _ in fits)
    near = [(p, s) for p, s in fits if p >= (1 - tolerance) * target] or [
        (p, s) for p, s in fits if p == best
    ]
    return max(near, key=lambda c: (min(c[1][a] / orig[a] for a in free), c[0]))[1]


# ---- slicing --------------------------------------------------------------------------------


def _top(score: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k largest scores, in their original order (ties: lower index first)."""
    order = torch.sort(score.double(), descending=True, stable=True).indices
    return order[:k].sort().values


def _expand(heads: torch.Tensor, hd: int) -> torch.Tensor:
    return (heads[:, None] * hd + torch.arange(hd)).flatten()


def keep_indices(scores: dict, orig: dict, s: dict, depth_metric: str = "block") -> dict:
    """Which channels, layers, heads and neurons survive (original indices, ascending)."""
    L0 = orig["num_hidden_layers"]
    metric = {"block": "block", "ppl": "ppl_drop"}.get(depth_metric)
    if metric is None or metric not in scores:
        raise CompressError(
            f"prune.depth_metric={depth_metric!r}: use 'block' (block importance) or 'ppl' "
            f"(perplexity drop; needs prune.ppl_samples > 0)."
        )
    layers = (
        _top(scores[metric], s["num_hidden_layers"])
        if s["num_hidden_layers"] < L0
        else torch.arange(L0)
    )
    rep0 = orig["num_attention_heads"] // orig["num_key_value_heads"]
    per_group = s["num_attention_heads"] // s["num_key_value_heads"]
    q_heads, kv_heads, neurons = [], [], []
    for l in layers.tolist():
        groups = _top(scores["groups"][l], s["num_key_value_heads"])
        heads = scores["heads"][l].view(-1, rep0)
        q_heads.append(torch.cat([g * rep0 + _top(heads[g], per_group) for g in groups.tolist()]))
        kv_heads.append(groups)
        neurons.append(_top(scores["neurons"][l], s["intermediate_size"]))
    return {
        "hidden": _top(scores["channels"], s["hidden_size"]),
        "layers": layers,
        "q_heads": q_heads,
        "kv_heads": kv_heads,
        "neurons": neurons,
    }


def pruned_config(config, s: dict, layers: torch.Tensor):
    new = copy.deepcopy(config)
    hd = head_dim(config)
    for a in AXES:
        setattr(new, a, int(s[a]))
    new.head_dim = hd  # HF would otherwise derive hidden_size // num_attention_heads
    if isinstance(
        getattr(config, "layer_types", None), list
    ):  # per-layer attention kinds (qwen2, ...)
        new.layer_types = [config.layer_types[i] for i in layers.tolist()]
    return new


@torch.no_grad()
def prune_model(
    model: nn.Module, scores: dict, sizes: dict, depth_metric: str = "block"
) -> nn.Module:
    """A new model of ``sizes``, its weights sliced from ``model`` by ``scores`` (importance.py)."""
    from transformers import AutoModelForCausalLM

    cfg, adapter = model.config, get_adapter(model.config)
    orig = sizes_of(cfg)
    s = {**orig, **sizes}
    check_sizes(orig, s, hidden_must_divide(cfg))
    keep = keep_indices(scores, orig, s, depth_metric)
    hd, hk = head_dim(cfg), keep["hidden"]
    new_cfg = pruned_config(cfg, s, keep["layers"])
    dtype = next(model.parameters()).dtype
    new = AutoModelForCausalLM.from_config(new_cfg, dtype=dtype)
    old = model.state_dict()

    roles = {path: role for role, path in adapter.linears}
    prefix = adapter.layers + "."

    def rule(name: str):
        """(source tensor name, slicing index per dim) for a tensor of the new model."""
        module, _, kind = name.rpartition(".")
        if name.startswith(prefix):
            j, _, path = name[len(prefix) :].partition(".")
            j = int(j)
            src = f"{prefix}{int(keep['layers'][j])}.{path}"
            mod_path = path.rpartition(".")[0]
            q, kv = _expand(keep["q_heads"][j], hd), _expand(keep["kv_heads"][j], hd)
            nk = keep["neurons"][j]
            out_in = {
                "q": (q, hk),
                "k": (kv, hk),
                "v": (kv, hk),
                "o": (hk, q),
                "gate": (nk, hk),
                "up": (nk, hk),
                "down": (hk, nk),
            }
            if mod_path in roles:
                idx = out_in[roles[mod_path]]
                return src, idx if kind == "weight" else idx[:1]
            if mod_path in adapter.norms():
                return src, (hk,)
            return src, None
        if module in (adapter.embed, adapter.lm_head):
            return name, (slice(None), hk)
        if module == adapter.final_norm:
            return name, (hk,)
        return name, None

    sd = {}
    for name, ref in new.state_dict().items():
        src, idx = rule(name)
        t = old[src]
        if idx is not None:
            for dim, i in enumerate(idx):
                if not isinstance(i, slice):
                    t = t.index_select(dim, i)
        if t.shape != ref.shape:
            raise CompressError(
                f"cannot slice tensor '{src}' {tuple(old[src].shape)} to {tuple(ref.shape)}: "
                f"compress/prune does not know this tensor's role."
            )
        sd[name] = t.contiguous()
    _keep_embed_scale(sd, model_spec(model), int(s["hidden_size"]), adapter)
    new.load_state_dict(sd, strict=True)
    if new_cfg.tie_word_embeddings:
        new.tie_weights()
        assert new.get_output_embeddings().weight is new.get_input_embeddings().weight
    return new.eval()


def _keep_embed_scale(sd: dict, spec, hidden: int, adapter) -> None:
    """Gemma multiplies the embeddings by sqrt(hidden_size), which transformers recomputes from
    the pruned config: scale the kept embedding rows by c = sqrt(D0 / D1) so the residual stream
    keeps its source scale, and, the head being tied, fold 1/c into the final norm's
    (offset + w) so the logits keep theirs."""
    if spec.embed_scale is None or hidden == spec.hidden_size:
        return
    c = math.sqrt(spec.hidden_size / hidden)
    key = f"{adapter.embed}.weight"
    sd[key] = (sd[key].double() * c).to(sd[key].dtype)
    if spec.tied:
        if f"{adapter.lm_head}.weight" in sd:  # the same tensor: loaded after the embedding
            sd[f"{adapter.lm_head}.weight"] = sd[key]
        key, o = f"{adapter.final_norm}.weight", spec.norm_offset
        sd[key] = ((o + sd[key].double()) / c - o).to(sd[key].dtype)


def param_total(model: nn.Module) -> int:
    """Unique parameters (tied ones counted once)."""
    return sum(p.numel() for p in model.parameters())
