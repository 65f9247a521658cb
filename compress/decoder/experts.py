"""The decoder's mixture-of-experts MLP: a router, the experts, and a shared expert (qwen2_moe).

For the rows x of the MLP's input (``compress.arch.moe`` gives the equations and the two router
kinds)::

    logits = F.linear(x, W_r)                           in the activations' dtype
    p = softmax(logits, fp32); (w, e) = top_k(p)        w <- w / sum(w) if the spec renormalizes
    softmax_topk:  w <- round(w)                        to the activations' dtype, then
                   y_j = round(w_j * f_e_j(x))          the product in that dtype
    topk_softmax:  y_j = round(w_j * f_e_j(x))          the product in fp32 (Mixtral)
    f_e(x) = down_e(act(gate_e(x)) * up_e(x))           gate_e, up_e the rows of gate_up_proj[e]
    y = sum_j y_j (+ sigmoid(g . x) * shared(x))

gpt-oss (``biased_topk_softmax``): the router's logits have a bias, w = softmax over the top-k
logits in the activations' dtype, and f_e is the clamped SwiGLU with the experts' biases
(``compress.arch.moe``); its checkpoint's experts (``gate_up_proj`` [E, H, 2I], gate and up
columns interleaved; ``down_proj`` [E, I, H]) are read into the layout above.

as transformers computes them, in its order: the experts' outputs are added into zeros expert
by expert, in ascending expert order. Only routed experts run: the rows routed to expert e are
gathered (``index_select``), run through ``gate_up_proj[e]`` and ``down_proj[e]`` and scattered
back (``index_add_``). With few rows (at most n_experts routed slots: decode) and in a compiled
step (``compress.decoder.compiled``), each row instead multiplies by its own k experts' weights,
gathered (``gate_up_proj[e]``), with no loop over experts and no host sync; either way a batch-1
decode step reads the weights of its top-k experts only.

Checkpoints hold the experts fused, as transformers holds them in memory
(``mlp.experts.gate_up_proj`` [E, 2I, H], gate rows first, ``mlp.experts.down_proj`` [E, H, I])
or per expert, as ``save_pretrained`` writes them (``mlp.experts.{e}.gate_proj.weight`` ...;
Mixtral ``block_sparse_moe.experts.{e}.w1/w3/w2``); :func:`fused_expert_tensors` reads both,
and per-expert compressed-tensors layers (``...gate_proj.weight_packed`` ..., an RTN or AWQ
run's). Those load as :class:`QuantExperts`: each expert a gated MLP of quantized layers
(``compress.layers.QuantLinear``, gate and up fused), so the experts stay in their 4 bits in
memory and run through the quantized kernels (W4A8 where the layer takes it), each routed
expert over the rows routed to it; a decode step's few rows, where every expert takes the W4A8
kernel, go through all their routed experts in one call (``w4a8_cpu.Experts``).
"""

import torch
import torch.nn.functional as F
from torch import nn

from compress.arch.moe import BIASED_TOPK, EXPERTS, SIGMOID_GROUP, SOFTMAX_TOPK, MoESpec
from compress.arch.spec import ArchSpec
from compress.errors import CompressError
from compress.formats import compressed_tensors as ct
from compress.kernels import cpu, w4a8_cpu


class Router(nn.Module):
    """``forward(x [N, H]) -> (w [N, k], e [N, k])``: the top-k experts of each row, weighted.
    The router keeps its weights in fp32 whatever the model's dtype (``keeps_fp32``): the
    sigmoid_group router computes in fp32 with its ``e_score_correction_bias``, as transformers
    does; the others round their fp32 logits to the activations' dtype, which is what a
    low-precision linear with fp32 accumulation gives (and a bf16 CPU matmul without bf16
    instructions takes ~10x as long)."""

    keeps_fp32 = True

    def __init__(self, moe: MoESpec, dim: int):
        super().__init__()
        self.top_k, self.kind, self.renorm = moe.top_k, moe.router, moe.norm_topk
        self.weight = nn.Parameter(torch.empty(moe.n_experts, dim))
        self.bias = nn.Parameter(torch.empty(moe.n_experts)) if moe.router == BIASED_TOPK else None
        if moe.router == SIGMOID_GROUP:
            self.register_buffer("e_score_correction_bias", torch.zeros(moe.n_experts))
            self.groups, self.topk_group, self.scale = moe.n_group, moe.topk_group, moe.routed_scale

    def forward(self, x):
        if self.kind == SIGMOID_GROUP:
            return self.sigmoid_group(x)
        bias = None if self.bias is None else self.bias.float()
        logits = F.linear(x.float(), self.weight.float(), bias).to(x.dtype)
        if self.kind == BIASED_TOPK:  # gpt-oss: the softmax of the top-k logits, in their dtype
            v, e = torch.topk(logits, self.top_k, dim=-1)
            return torch.softmax(v, dim=-1, dtype=v.dtype), e
        p = torch.softmax(logits, dim=-1, dtype=torch.float32)
        w, e = torch.topk(p, self.top_k, dim=-1)
        if self.renorm:
            w = w / w.sum(dim=-1, keepdim=True)
        if self.kind == SOFTMAX_TOPK:
            w = w.to(logits.dtype)
        return w, e

    def sigmoid_group(self, x):
        """DeepSeek V3's router (``compress.arch.moe``): w in fp32."""
        s = F.linear(x.float(), self.weight.float()).sigmoid()
        c = s + self.e_score_correction_bias.float()
        G = self.groups
        group = c.unflatten(-1, (G, -1)).topk(2, dim=-1)[0].sum(-1)  # [N, G]
        best = torch.topk(group, self.topk_group, dim=-1, sorted=False)[1]
        keep = torch.zeros_like(group).scatter_(1, best, 1).bool()
        c = c.masked_fill(~keep.repeat_interleave(c.shape[-1] // G, -1), float("-inf"))
        e = torch.topk(c, self.top_k, dim=-1, sorted=False)[1]
        w = s.gather(1, e)
        if self.renorm:
            w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
        return w * self.scale, e


class Experts(nn.Module):
    """``forward(x [N, H], w [N, k], e [N, k]) -> [N, H]``: each routed expert over its rows
    (with the spec's expert biases ``gate_up_proj_bias`` [E, 2I], ``down_proj_bias`` [E, H])."""

    def __init__(self, moe: MoESpec, dim: int, act):
        super().__init__()
        E, inter = moe.n_experts, moe.intermediate_size
        self.n_experts, self.act = E, act
        self.limit, self.alpha = moe.swiglu_limit, moe.swiglu_alpha
        self.gate_up_proj = nn.Parameter(torch.empty(E, 2 * inter, dim))
        self.down_proj = nn.Parameter(torch.empty(E, dim, inter))
        self.gate_up_proj_bias = self.down_proj_bias = None
        if moe.expert_bias:
            self.gate_up_proj_bias = nn.Parameter(torch.empty(E, 2 * inter))
            self.down_proj_bias = nn.Parameter(torch.empty(E, dim))

    def glu(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``act(gate) * up``, or gpt-oss's clamped SwiGLU (``compress.arch.moe``)."""
        gate, up = gate_up.chunk(2, -1)
        if self.limit is None:
            return self.act(gate) * up
        gate, up = gate.clamp(max=self.limit), up.clamp(-self.limit, self.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))

    def forward(self, x, w, e):
        if torch.compiler.is_compiling() or x.shape[0] * e.shape[-1] <= self.n_experts:
            return self.gathered(x, w, e)
        return self.grouped(x, w, e)

    def gathered(self, x, w, e):
        """Each row through its own k experts' weights, gathered (decode: no loop, no sync)."""
        e, order = e.sort(dim=-1)  # ascending expert, the order transformers adds them in
        w = w.gather(-1, order)
        gate_up = (self.gate_up_proj[e] @ x[:, None, :, None]).squeeze(-1)
        if self.gate_up_proj_bias is not None:
            gate_up = gate_up + self.gate_up_proj_bias[e]
        y = (self.down_proj[e] @ self.glu(gate_up)[..., None]).squeeze(-1)  # [N, k, H]
        if self.down_proj_bias is not None:
            y = y + self.down_proj_bias[e]
        out = torch.zeros_like(x)
        for j in range(e.shape[-1]):
            out = out + (y[:, j] * w[:, j, None]).to(out.dtype)
        return out

    def grouped(self, x, w, e):
        """Each routed expert over the rows routed to it, in ascending expert order."""

        biased = self.gate_up_proj_bias is not None

        def run(expert, rows):
            gu_bias = self.gate_up_proj_bias[expert] if biased else None
            gate_up = F.linear(rows, self.gate_up_proj[expert], gu_bias)
            d_bias = self.down_proj_bias[expert] if biased else None
            return F.linear(self.glu(gate_up), self.down_proj[expert], d_bias)

        return each_routed(x, w, e, self.n_experts, run)


def each_routed(x, w, e, n_experts: int, run) -> torch.Tensor:
    """``sum_j w_j * run(e_j, x)`` per row, computed expert by expert in ascending order over
    the rows routed to each (``run(expert, rows) -> [n, H]``), added into zeros in x's dtype."""
    out = torch.zeros_like(x)
    k = e.shape[-1]
    flat = e.reshape(-1)
    order = flat.argsort(stable=True)  # routed (row, j) slots grouped by expert
    counts = torch.bincount(flat, minlength=n_experts).tolist()
    weights, at = w.reshape(-1, 1), 0
    for expert, n in enumerate(counts):
        if not n:
            continue
        slots = order[at : at + n]
        at += n
        rows = slots // k
        y = run(expert, x.index_select(0, rows))
        out.index_add_(0, rows, (y * weights.index_select(0, slots)).to(out.dtype))
    return out


class GatedExpert(nn.Module):
    """One expert's gated MLP under the family's per-expert names (``names``: gate, up, down);
    after loading, gate and up are fused into ``gate_up_proj`` (``fuse``)."""

    def __init__(self, dim: int, inter: int, names: tuple):
        super().__init__()
        self.names = names
        for name, shape in zip(names, ((dim, inter), (dim, inter), (inter, dim))):
            self.add_module(name, nn.Linear(*shape, bias=False))
        self.gate_up_proj = None

    def forward(self, x, act):
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return getattr(self, self.names[2])(act(gate) * up)


class QuantExperts(nn.Module):
    """``forward(x [N, H], w [N, k], e [N, k]) -> [N, H]`` of experts held as quantized layers,
    ``experts.{e}.{names}`` (see the module docstring): each routed expert over its rows, in
    ascending expert order, as :meth:`Experts.grouped`."""

    # a compiled step runs it outside the graph (its loop syncs with the host), unless it takes
    # the one-call W4A8 kernel (compiled.with_static_linears)
    graph_break = True

    def __init__(self, moe: MoESpec, dim: int, act, names: tuple):
        super().__init__()
        self.n_experts, self.act = moe.n_experts, act
        for e in range(moe.n_experts):
            self.add_module(str(e), GatedExpert(dim, moe.intermediate_size, names))
        self.fused = None  # w4a8_cpu.Experts over every expert, once they all take the kernel

    @torch.compiler.disable
    def forward(self, x, w, e):
        few = x.shape[0] * e.shape[-1] <= self.n_experts
        if (few or self._modules["0"].gate_up_proj.kernel_every_m) and (fused := self.w4a8(x)):
            return fused(x, w, e)  # every M under kernel_every_m: a row's bits are its own
        return each_routed(
            x, w, e, self.n_experts, lambda expert, rows: self._modules[str(expert)](rows, self.act)
        )

    def w4a8(self, x) -> "w4a8_cpu.Experts | None":
        """The one-call kernel over all routed experts (``w4a8_cpu.Experts``: decode's few rows),
        where it computes what the experts' own W4A8 layers would: CPU rows, SiLU, every expert's
        layers on the kernel (``w4a8_cpu.use`` sets them all alike) with one width and group
        size, and a C++ path."""
        first = self._modules["0"].gate_up_proj
        if (
            self.act is not F.silu
            or x.device.type != "cpu"
            or not cpu.takes_w4a8(first)
            or w4a8_cpu.path() == "ref"
        ):
            return None
        if self.fused is None:
            experts = [self._modules[str(i)] for i in range(self.n_experts)]
            gate_up = [m.gate_up_proj for m in experts]
            down = [getattr(m, m.names[2]) for m in experts]
            alike = all(
                cpu.takes_w4a8(m) and (m.bits, m.group_size) == (ms[0].bits, ms[0].group_size)
                for ms in (gate_up, down)
                for m in ms
            )
            fused = w4a8_cpu.Experts(gate_up, down) if alike else None
            self.fused = fused if fused is not None and fused.uniform else False
        return self.fused or None


def quantized_experts(model: nn.Module, spec: ArchSpec, qcfg: dict | None) -> int:
    """Replace each sparse layer's float :class:`Experts` by :class:`QuantExperts` where the
    folder's compressed-tensors ``qcfg`` quantizes its experts (still on the meta device, before
    the quantized layers are swapped in); returns how many."""
    if spec.moe is None or (qcfg or {}).get("quant_method") != ct.METHOD:
        return 0
    a, n = spec.adapter, 0
    for layer in spec.layers:
        where = f"{a.layers}.{layer.index}.{a.mlp}"
        if (
            layer.mlp != EXPERTS
            or ct.scheme(qcfg, f"{where}.experts.0.{a.expert_names[0]}") is None
        ):
            continue
        mlp = model.get_submodule(where)
        mlp.experts = QuantExperts(spec.moe, spec.hidden_size, mlp.experts.act, a.expert_names)
        n += 1
    return n


class SparseMoE(nn.Module):
    """A sparse layer's MLP: ``mlp.gate`` (the router), ``mlp.experts`` and, given ``shared``
    (a dense MLP of the shared expert's width), the shared expert under the family's name
    (``mlp.shared_expert`` weighted by ``sigmoid(mlp.shared_expert_gate(x))``, qwen2_moe;
    ``mlp.shared_experts`` ungated, deepseek_v3)."""

    def __init__(self, spec: ArchSpec, act, shared: nn.Module | None = None):
        super().__init__()
        self.gate = Router(spec.moe, spec.hidden_size)
        self.experts = Experts(spec.moe, spec.hidden_size, act)
        self.shared_name = spec.adapter.shared_name if shared is not None else None
        self.gated = shared is not None and spec.moe.shared_gated
        if shared is not None:
            self.add_module(self.shared_name, shared)
        if self.gated:
            self.shared_expert_gate = nn.Linear(spec.hidden_size, 1, bias=False)

    def shared(self) -> nn.Module | None:
        """The shared expert, if any."""
        return getattr(self, self.shared_name) if self.shared_name else None

    def forward(self, x):
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        y = self.experts(x, *self.gate(x))
        shared = self.shared()
        if shared is not None:
            z = shared(x)
            y = y + (torch.sigmoid(self.shared_expert_gate(x)) * z if self.gated else z)
        return y.view(shape)


def untransposed_experts(tensors: dict, p: str) -> dict:
    """gpt-oss's experts ``p`` in our layout: ``gate_up_proj`` [E, H, 2I] (gate, up columns
    interleaved) -> [E, 2I, H] gate rows first, its bias likewise, ``down_proj`` [E, I, H] ->
    [E, H, I]."""
    gu, down = tensors[f"{p}.gate_up_proj"], tensors.get(f"{p}.down_proj")
    if gu.dim() != 3 or down is None or down.dim() != 3:
        raise CompressError(
            f"'{p}.gate_up_proj' and '{p}.down_proj' must be [experts, hidden, 2 x width] and "
            f"[experts, width, hidden] float tensors, as transformers saves gpt-oss; an MXFP4 "
            f"checkpoint (..._blocks, ..._scales) must be dequantized first (transformers: "
            f"Mxfp4Config(dequantize=True), then save_pretrained)."
        )
    out = {
        f"{p}.gate_up_proj": torch.cat([gu[..., 0::2], gu[..., 1::2]], -1).transpose(1, 2),
        f"{p}.down_proj": down.transpose(1, 2),
    }
    bias = tensors.get(f"{p}.gate_up_proj_bias")
    if bias is not None:
        out[f"{p}.gate_up_proj_bias"] = torch.cat([bias[..., 0::2], bias[..., 1::2]], -1)
    return {k: v.contiguous() for k, v in out.items()}


def dequantized_experts(tensors: dict, qcfg: dict | None) -> dict:
    """``tensors`` with every expert's compressed-tensors layer (``...experts.{e}.NAME.weight_packed``
    and its scale, zero point and shape) replaced by its float ``...NAME.weight``."""
    if (qcfg or {}).get("quant_method") != ct.METHOD:
        return tensors
    suffix = ".weight_packed"
    layers = [n[: -len(suffix)] for n in tensors if n.endswith(suffix) and ".experts." in n]
    for prefix in layers:
        local = {k: tensors.pop(f"{prefix}.{k}") for k in ct.NAMES if f"{prefix}.{k}" in tensors}
        got = ct.scheme(qcfg, prefix)
        if got is None:
            raise CompressError(
                f"expert layer '{prefix}' is stored compressed, but the quantization_config's "
                f"ignore list or targets leave it in floating point; fix config.json."
            )
        tensors[f"{prefix}.weight"] = ct.dequantize(local, *got)
    return tensors


def fused_expert_tensors(tensors: dict, spec: ArchSpec, qcfg: dict | None = None) -> dict:
    """A checkpoint's tensors with each sparse layer's experts fused (see the module docstring):
    the family's MLP aliases renamed, per-expert weights (compressed-tensors ones dequantized)
    stacked into ``gate_up_proj`` and ``down_proj``; fused ones, and every other tensor, as
    they are."""
    if spec.moe is None:
        return tensors
    a = spec.adapter
    out, stored = {}, {}  # stored: our name -> the checkpoint's
    for name, t in dequantized_experts(tensors, qcfg).items():
        ours = a.ours(name)
        out[ours], stored[ours] = t, name
    g, u, d = a.expert_names
    for layer in spec.layers:
        if layer.mlp != EXPERTS:
            continue
        p = f"{a.layers}.{layer.index}.{a.mlp}.experts"
        if a.expert_layout == "transposed" and f"{p}.gate_up_proj" in out:
            out.update(untransposed_experts(out, p))
            continue
        parts = {
            role: [out.pop(f"{p}.{e}.{name}.weight", None) for e in range(spec.moe.n_experts)]
            for role, name in (("gate", g), ("up", u), ("down", d))
        }
        found = [t for ts in parts.values() for t in ts if t is not None]
        if not found:
            continue  # fused, or missing: load_state names what it lacks
        if len(found) < 3 * spec.moe.n_experts:
            missing = next(
                f"{p}.{e}.{name}.weight"
                for (role, ts), name in zip(parts.items(), (g, u, d))
                for e, t in enumerate(ts)
                if t is None
            )
            here = next(n for n in stored.values() if f".{layer.index}." in n and ".experts." in n)
            prefix = here[: here.index(".experts.")]  # the checkpoint's name of the MLP
            missing = prefix + missing[len(f"{a.layers}.{layer.index}.{a.mlp}") :]
            raise CompressError(
                f"the checkpoint holds some of layer {layer.index}'s experts but lacks "
                f"'{missing}'; it does not match its config.json (num experts "
                f"{spec.moe.n_experts})."
            )
        if f"{p}.gate_up_proj" in out:
            raise CompressError(
                f"the checkpoint holds layer {layer.index}'s experts both fused and per expert; "
                f"keep one form."
            )
        out[f"{p}.gate_up_proj"] = torch.stack(
            [torch.cat([gt, ut]) for gt, ut in zip(parts["gate"], parts["up"])]
        )
        out[f"{p}.down_proj"] = torch.stack(parts["down"])
    return out
