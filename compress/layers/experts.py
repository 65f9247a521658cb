"""Experts as one gated MLP per expert, so that the methods reach every expert's linears.

transformers 5 holds a sparse layer's experts fused (``mlp.experts.gate_up_proj`` [E, 2I, H],
gate rows first, and ``mlp.experts.down_proj`` [E, H, I]), which a quantizer looking for
``nn.Linear`` never sees. :func:`unfuse_experts` replaces that module by :class:`LinearExperts`:
``experts.{e}.{gate,up,down}`` linears (the family's per-expert names on disk: Mixtral's
``w1``/``w3``/``w2``), computing what transformers' eager experts compute::

    y = sum over the routed (token, j): w_j * down_e(act(gate_e(x)) * up_e(x)), e = e_j

expert by expert in ascending order, added into zeros in the activations' dtype. Its state dict
holds one tensor per expert, the layout source checkpoints, llm-compressor and the
compressed-tensors loaders use.
"""

import torch
from torch import nn


class Expert(nn.Module):
    """One expert's gated MLP; its linears carry the family's names (``names``)."""

    def __init__(self, hidden: int, inter: int, names: tuple):
        super().__init__()
        self.names = names
        with torch.device("meta"):  # from_fused sets the weights
            layers = (nn.Linear(hidden, inter, bias=False), nn.Linear(hidden, inter, bias=False))
            layers += (nn.Linear(inter, hidden, bias=False),)
        for name, layer in zip(names, layers):
            self.add_module(name, layer)

    def forward(self, x, act):
        g, u, d = (getattr(self, n) for n in self.names)
        return d(act(g(x)) * u(x))


class LinearExperts(nn.Module):
    """``forward(hidden [N, H], top_k_index [N, k], top_k_weights [N, k]) -> [N, H]``, the
    signature of transformers' experts modules (see the module docstring)."""

    def __init__(self, n_experts: int, hidden: int, inter: int, act, names: tuple):
        super().__init__()
        self.n_experts, self.act_fn = n_experts, act
        for e in range(n_experts):
            self.add_module(str(e), Expert(hidden, inter, names))

    @classmethod
    def from_fused(cls, fused: nn.Module, names: tuple) -> "LinearExperts":
        """The experts of transformers' fused module ``fused``, copied expert by expert."""
        gate_up, down = fused.gate_up_proj, fused.down_proj
        E, two_i, hidden = gate_up.shape
        out = cls(E, hidden, two_i // 2, fused.act_fn, names)
        for e in range(E):
            g, u, d = (getattr(out[e], n) for n in names)
            gate, up = gate_up[e].chunk(2, 0)
            for layer, w in ((g, gate), (u, up), (d, down[e])):
                layer.weight = nn.Parameter(w.detach().clone(), requires_grad=gate_up.requires_grad)
        return out

    def __getitem__(self, e: int) -> Expert:
        return self._modules[str(e)]

    def forward(self, hidden_states, top_k_index, top_k_weights):
        out = torch.zeros_like(hidden_states)
        with torch.no_grad():
            mask = nn.functional.one_hot(top_k_index, self.n_experts).permute(2, 1, 0)
            hit = (mask.sum(dim=(-1, -2)) > 0).nonzero().flatten().tolist()
        for e in hit:
            pos, rows = torch.where(mask[e])
            y = self[e](hidden_states[rows], self.act_fn) * top_k_weights[rows, pos, None]
            out.index_add_(0, rows, y.to(out.dtype))
        return out


def unfuse_experts(model: nn.Module, adapter) -> int:
    """Replace every fused experts module of ``model`` (transformers') by :class:`LinearExperts`
    in place, with ``adapter``'s (``compress.arch.adapters.Adapter``) names; returns how many."""
    n = 0
    for layer in adapter.decoder_layers(model):
        mlp = layer.get_submodule(adapter.mlp)
        fused = getattr(mlp, "experts", None)
        if fused is not None and isinstance(getattr(fused, "gate_up_proj", None), torch.Tensor):
            mlp.experts = LinearExperts.from_fused(fused, adapter.expert_names)
            n += 1
    return n
