"""Calibration pass: each decoder layer's attention input ``x = input_layernorm(h)`` on text."""

import torch

from compress.arch.adapters import get_adapter


@torch.no_grad()
def attention_inputs(model, tokens: torch.Tensor, *visitors, batch_size: int = 4) -> None:
    """Run ``model`` on ``tokens [samples, seqlen]``; call each ``visit(layer, x [tokens, hidden])``
    with every layer's attention input, layer after layer within each batch."""
    layers = get_adapter(model.config).decoder_layers(model)

    def hook(i):
        def pre(_module, args, kwargs):
            x = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
            for visit in visitors:
                visit(i, x.reshape(-1, x.shape[-1]))

        return pre

    handles = [
        layer.self_attn.register_forward_pre_hook(hook(i), with_kwargs=True)
        for i, layer in enumerate(layers)
    ]
    try:
        for start in range(0, tokens.shape[0], batch_size):
            model(tokens[start : start + batch_size], use_cache=False)
    finally:
        for h in handles:
            h.remove()


class InputGram:
    """A visitor for ``attention_inputs``: ``grams()`` gives each layer's E[x x^T] (float64);
    with ``bias``, E[[x, 1][x, 1]^T] (for projections with a bias as a last column)."""

    def __init__(self, bias: bool = False):
        self.sums, self.count, self.bias = {}, 0, bias

    def __call__(self, i, x):
        x = x.double()
        if self.bias:
            x = torch.cat((x, torch.ones_like(x[:, :1])), dim=1)
        self.sums[i] = self.sums[i] + x.T @ x if i in self.sums else x.T @ x
        if i == 0:
            self.count += x.shape[0]

    def grams(self) -> list[torch.Tensor]:
        return [self.sums[i] / self.count for i in sorted(self.sums)]
