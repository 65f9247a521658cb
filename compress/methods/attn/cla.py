"""Cross-layer attention from a trained Llama (Brandon et al. 2024, arXiv 2405.12981).

Layers f .. f+s-1 (f a multiple of the sharing factor s) attend with the K/V that layer f
computes from its own input x_f; the others lose ``k_proj``/``v_proj``. The one free choice
per group and projection (K, V) is layer f's weight M (``y = x M``). Two initialisations:

``first``: M = M_f, layer f's own projection.

``lstsq``: M fits every layer's own K (or V) on calibration text, the input of the shared
projection being x_f for all of them::

    min_M  sum_{l in group} || X_f M - X_l M_l ||^2
    =>     M = (X_f^T X_f)^{-1} (1/s) sum_l (X_f^T X_l) M_l

(K is fitted before RoPE: RoPE rotates both sides by the same orthogonal matrix.) A
projection with a bias fits [X, 1] against [M; b]. ``lstsq`` is the default: on SmolLM2-135M,
training-free, it gives the lower perplexity (``python eval/bench/attn_ablation.py cla``).
"""

import torch

from compress.arch.adapters import get_adapter
from compress.errors import CompressError
from compress.formats.attention import CLAConfig, CLAForCausalLM, converted_config
from compress.methods.attn.calib import attention_inputs

INITS = ("first", "lstsq")


def check_share(config, share: int, init: str) -> None:
    layers = config.num_hidden_layers
    if share < 1 or layers % share:
        valid = [d for d in range(1, layers + 1) if layers % d == 0]
        raise CompressError(
            f"attn.share={share} must divide the model's {layers} layers (each "
            f"group of share layers uses its first layer's K/V); valid values: "
            f"{', '.join(map(str, valid))}."
        )
    if init not in INITS:
        raise CompressError(f"attn.cla_init={init!r}: use one of {', '.join(INITS)}.")


def augmented(x: torch.Tensor, bias: bool) -> torch.Tensor:
    x = x.double()
    return torch.cat((x, torch.ones_like(x[:, :1])), dim=1) if bias else x


def cross_moments(model, tokens, share: int, bias: bool) -> dict[int, dict[int, torch.Tensor]]:
    """``{f: {l: X_f^T X_l}}`` over the calibration tokens, for every group first f and member l."""
    moments, first_x = {}, {}

    def visit(i, x):
        f = i - i % share
        x = augmented(x, bias)
        if i == f:
            first_x[f] = x
        m = moments.setdefault(f, {})
        xtx = first_x[f].T @ x
        m[i] = m[i] + xtx if i in m else xtx

    attention_inputs(model, tokens, visit)
    return moments


def fit_shared(
    moments: dict[int, torch.Tensor],
    weights: dict[int, torch.Tensor],
    first: int,
    damp: float = 1e-6,
) -> torch.Tensor:
    """The least-squares shared weight ``[out, in(+1)]`` from ``X_f^T X_l`` and each W_l."""
    gram = moments[first]
    gram = gram + damp * gram.diagonal().mean() * torch.eye(gram.shape[0], dtype=gram.dtype)
    rhs = sum(moments[layer] @ weights[layer].double().T for layer in weights) / len(weights)
    return torch.linalg.solve(gram, rhs).T


def projection(linear) -> torch.Tensor:
    """``[out, in(+1)]``: the weight, with the bias as a last column if there is one."""
    w = linear.weight.detach()
    return torch.cat((w, linear.bias.detach()[:, None]), dim=1) if linear.bias is not None else w


def convert_cla(model, share: int, init: str = "lstsq", tokens: torch.Tensor | None = None):
    """A ``CLAForCausalLM`` with ``model``'s weights, K/V shared in groups of ``share`` layers."""

    config = model.config
    check_share(config, share, init)
    adapter = get_adapter(config)
    layers = adapter.decoder_layers(model)
    bias = adapter.linear(layers[0], "k").bias is not None
    moments = cross_moments(model, tokens, share, bias) if init == "lstsq" and share > 1 else None
    state = model.state_dict()
    paths = dict(adapter.linears)
    for f in range(0, len(layers), share):
        for role in ("k", "v"):
            prefix = f"{adapter.layers}.{f}.{paths[role]}"
            if moments is not None:
                ws = {i: projection(adapter.linear(layers[i], role)) for i in range(f, f + share)}
                fitted = fit_shared(moments[f], ws, f).to(state[prefix + ".weight"].dtype)
                state[prefix + ".weight"] = fitted[:, :-1] if bias else fitted
                if bias:
                    state[prefix + ".bias"] = fitted[:, -1]
            for i in range(f + 1, f + share):
                for kind in ("weight", "bias"):
                    state.pop(f"{adapter.layers}.{i}.{paths[role]}.{kind}", None)
    out = CLAForCausalLM(converted_config(CLAConfig, config, cla_share=share))
    out = out.to(next(model.parameters()).dtype)
    out.load_state_dict(state, strict=True)
    return out.eval()
