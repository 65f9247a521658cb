"""Residual-stream rotation (QuaRot, Ashkboos et al. 2024, arXiv 2404.00456; SpinQuant's R1,
Liu et al. 2024, arXiv 2405.16406), folded into the weights so the model needs no online
transform.

An RMSNorm without weight commutes with an orthogonal Q: rms(xQ) = rms(x). So with the norms'
weights first folded into the linears that read them, every hidden state h of the residual
stream can be carried as hQ::

    fold:    W_r <- W_r diag(o + g)     for each linear r reading norm n (weight g, offset o);
             then g <- 1 - o           (n is a plain RMSNorm); the final norm into the head
    rotate:  E   <- E Q                the embedding rows
             W_r <- W_r Q              q, k, v, gate, up, the head: [out, in] read h
             W_w <- Q^T W_w,  b_w <- b_w Q    o and down: [out, in] write into h

and the logits are unchanged (x Q (W Q)^T = x W^T). Q is a random Hadamard matrix
H diag(+-1) / sqrt(n): it spreads each outlier channel over all n channels, which is what
helps the round-to-grid of the quantizers after it. H of order n is built as Kronecker
products of Sylvester (2^k) and Paley I (q + 1, q prime, q = 3 mod 4) matrices; an order
with no such factorization gets a random orthogonal Q (QR of a Gaussian) instead, and says so.

A mixture of experts reads the stream with its router, every expert's gate/up (fused
[E, 2I, H], gpt-oss's [E, H, 2I], or one linear per expert), the shared expert and its gate,
and writes with every expert's down; latent attention reads it with the query, RoPE-key and
latent down-projections (DeepSeek V3: ``Adapter.stream_reads``). A tied head is untied (the
final norm's weight goes into the head alone). Families with norms on the branch outputs
(Gemma 3's ``attn_out_norm`` / ``mlp_out_norm``: their weight acts inside the rotated basis)
are refused: they need an online transform.
"""

import logging
import math

import torch
from torch import nn

from compress.arch.adapters import get_adapter, has_path
from compress.errors import CompressError
from compress.io.offload import layer_on
from compress.layers.experts import LinearExperts

log = logging.getLogger(__name__)

READS = ("q", "k", "v", "k_rope", "kv_a")  # attention roles reading the stream (through a norm)
DENSE = ("gate_proj", "up_proj", "down_proj")  # a gated MLP's linears where no entry names them
KINDS = ("hadamard", "orthogonal")


def _is_prime(q: int) -> bool:
    return q > 1 and all(q % d for d in range(2, math.isqrt(q) + 1))


def paley(q: int) -> torch.Tensor:
    """Paley construction I: a Hadamard matrix of order q + 1, q prime and q = 3 (mod 4)."""
    chi = torch.zeros(q, dtype=torch.float64)
    for x in range(1, q):
        chi[x * x % q] = 1.0
    chi = torch.where(chi > 0, 1.0, -1.0)
    chi[0] = 0.0
    i = torch.arange(q)
    jac = chi[(i[None, :] - i[:, None]) % q]  # Q[a, b] = chi(b - a): skew-symmetric
    s = torch.zeros(q + 1, q + 1, dtype=torch.float64)
    s[0, 1:], s[1:, 0], s[1:, 1:] = 1.0, -1.0, jac
    return s + torch.eye(q + 1, dtype=torch.float64)


def _factor(n: int) -> list[int] | None:
    """Orders whose Kronecker product is n: powers of two and Paley orders, or None."""
    if n == 1:
        return []
    if n % 2 == 0 and n & (n - 1) == 0:
        return [n]
    for m in range(n, 3, -1):  # the largest Paley factor first: fewest factors
        if n % m == 0 and m % 4 == 0 and _is_prime(m - 1) and (m - 1) % 4 == 3:
            rest = _factor(n // m)
            if rest is not None:
                return [m, *rest]
    return None


def hadamard(n: int) -> torch.Tensor | None:
    """An n x n matrix of +-1 with H H^T = n I (float64), or None when n has no factorization
    into Sylvester and Paley orders."""
    orders = _factor(n)
    if orders is None:
        return None
    h = torch.ones(1, 1, dtype=torch.float64)
    for m in orders:
        if m & (m - 1) == 0:
            f = torch.ones(1, 1, dtype=torch.float64)
            while f.shape[0] < m:
                f = torch.cat([torch.cat([f, f], 1), torch.cat([f, -f], 1)], 0)
        else:
            f = paley(m - 1)
        h = torch.kron(h, f)
    return h


def rotation(n: int, kind: str = "hadamard", seed: int = 0) -> torch.Tensor:
    """The orthogonal n x n Q of the module docstring (float64), reproducible from ``seed``."""
    gen = torch.Generator().manual_seed(seed)
    if kind == "hadamard":
        h = hadamard(n)
        if h is not None:
            signs = torch.randint(0, 2, (n,), generator=gen).double() * 2 - 1
            return signs[:, None] * h / math.sqrt(n)
        log.warning("no Hadamard matrix of order %d is built here; rotating orthogonally", n)
    q, r = torch.linalg.qr(torch.randn(n, n, generator=gen, dtype=torch.float64))
    return q * torch.sign(torch.diagonal(r))[None, :]


def check(cfg, hf_config=None) -> None:
    """Refuse the ``rotate.*`` settings and a family a folded rotation cannot carry (a rotation
    after a quantizing stage is refused by ``compress.recipe.config``: those come last)."""
    r = cfg.get("rotate") or {}
    kind = r.get("kind", "hadamard")
    if kind not in KINDS:
        raise CompressError(
            f"rotate.kind={kind!r} is not a rotation; use one of {', '.join(KINDS)}."
        )
    seed = r.get("seed", 0)
    if not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed < 2**63:
        raise CompressError(f"rotate.seed={seed!r}: give an integer in [0, 2**63).")
    if hf_config is not None:
        check_family(hf_config)


def check_family(config) -> None:
    """Refuse a family whose norms a folded rotation cannot carry."""
    a = get_adapter(config)
    if a.attn_out_norm or a.mlp_out_norm:
        raise CompressError(
            f"{a.family} has norms on the attention and MLP outputs "
            f"({a.attn_out_norm}, {a.mlp_out_norm}), whose weights act inside the rotated "
            f"basis: a folded rotation is not exact there. Leave out the rotate stage."
        )


def _mlp_io(mlp: nn.Module, a) -> tuple[list, list]:
    """``(reads, writes)`` of a mixture-of-experts family's MLP: ``(tensor, axis)`` pairs, the
    axis the one of width hidden. A sparse MLP reads with its router (gpt-oss: ``router``), its
    experts (fused ``gate_up_proj`` [E, 2I, H] or gpt-oss's [E, H, 2I]; or one linear per expert,
    ``compress.layers.experts``), its shared expert and qwen2_moe's shared gate; its down
    projections ([E, H, I], gpt-oss's [E, I, H] with a bias [E, H]) write."""
    reads, writes = [], []

    def gated(m, names=DENSE):
        g, u, d = (getattr(m, n) for n in names)
        reads.extend([(g.weight, -1), (u.weight, -1)])
        writes.extend(_writes(d))

    experts = getattr(mlp, "experts", None)
    if experts is None:  # a dense layer
        gated(mlp)
        return reads, writes
    router = mlp.router if hasattr(mlp, "router") else mlp.gate
    reads.append((router.weight, -1))
    if isinstance(experts, LinearExperts):
        for e in range(experts.n_experts):
            gated(experts[e], experts[e].names)
    elif a.expert_layout == "fused":
        reads.append((experts.gate_up_proj, -1))
        writes.append((experts.down_proj, -2))
    else:  # transposed: the residual on the input side of gate_up, the output side of down
        reads.append((experts.gate_up_proj, -2))
        writes.extend([(experts.down_proj, -1), (experts.down_proj_bias, -1)])
    shared = getattr(mlp, a.shared_name, None)
    if shared is not None:
        gated(shared)
    if hasattr(mlp, "shared_expert_gate"):
        reads.append((mlp.shared_expert_gate.weight, -1))
    return reads, writes


def _writes(lin: nn.Linear) -> list:
    """A linear adding into the stream: its weight's output axis, its bias."""
    return [(lin.weight, -2)] + ([(lin.bias, -1)] if lin.bias is not None else [])


def _layer_io(layer: nn.Module, a) -> tuple[list, list, list]:
    """``(read after the input norm, read after the post norm, written into the stream)`` of one
    decoder layer, as ``(tensor, axis)`` pairs (:func:`_mlp_io`)."""
    named = a.named_linears(layer)  # the roles this layer has (CLA: some without k/v)
    present = {r: named[p] for r, p in a.linears if p in named}
    reads = [present[r] for r in READS if r in present]
    reads += [layer.get_submodule(p) for p in a.stream_reads if has_path(layer, p)]
    writes = [present["o"]] if "o" in present else []
    writes += [layer.get_submodule(p) for p in a.stream_writes]
    if "gate" in present:  # a dense family
        mlp_reads = [(present[r].weight, -1) for r in ("gate", "up")]
        mlp_writes = _writes(present["down"])
    else:
        mlp_reads, mlp_writes = _mlp_io(layer.get_submodule(a.mlp), a)
    attn_writes = [t for lin in writes for t in _writes(lin)]
    return [(lin.weight, -1) for lin in reads], mlp_reads, attn_writes + mlp_writes


def _each(t: torch.Tensor, fn) -> None:
    """``t <- fn(t)`` in float64, expert by expert for a stacked [E, ...] tensor."""
    for part in t.unbind(0) if t.dim() == 3 else (t,):
        part.copy_(fn(part.double()).to(part.dtype))


def _fold(norm: nn.Module, offset: float, reads: list) -> None:
    """Scale each reading tensor's hidden axis by (offset + g); the norm's weight becomes the
    identity."""
    gain = norm.weight.double() + offset
    for t, axis in reads:
        g = gain.to(t.device)
        _each(t.data, lambda w, g=g, axis=axis: w * (g if axis == -1 else g[:, None]))
    norm.weight.fill_(1.0 - offset)


def _turn(t: torch.Tensor, axis: int, q: torch.Tensor) -> None:
    """Carry the hidden axis of ``t`` into the rotated basis: ``t Q`` on the last axis, ``Q^T t``
    on the one before (a reader's [out, in] or a writer's [out, in] weight, a writer's bias)."""
    q = q.to(t.device)
    _each(t.data, (lambda w: w @ q) if axis == -1 else (lambda w: q.T @ w))


@torch.no_grad()
def rotate_model(model: nn.Module, kind: str = "hadamard", seed: int = 0, device=None) -> nn.Module:
    """Fold the norms and rotate the residual stream of ``model`` in place (module docstring),
    one decoder layer at a time on ``device``."""
    config = model.config
    check_family(config)
    a = get_adapter(config)
    q = rotation(config.hidden_size, kind, seed)
    embed, head = model.get_submodule(a.embed), model.get_submodule(a.lm_head)
    if head.weight is embed.weight or getattr(config, "tie_word_embeddings", False):
        head.weight = nn.Parameter(embed.weight.detach().clone())
        config.tie_word_embeddings = False
        if hasattr(model, "_tied_weights_keys"):
            model._tied_weights_keys = None
    for i in range(len(a.decoder_layers(model))):
        with layer_on(model, i, device, write=True) as layer:
            attn_reads, mlp_reads, writes = _layer_io(layer, a)
            _fold(layer.get_submodule(a.input_norm), a.norm_offset, attn_reads)
            _fold(layer.get_submodule(a.post_norm), a.norm_offset, mlp_reads)
            for t, axis in attn_reads + mlp_reads + writes:
                _turn(t, axis, q)
    _fold(model.get_submodule(a.final_norm), a.norm_offset, [(head.weight, -1)])
    _turn(embed.weight, -1, q)
    _turn(head.weight, -1, q)
    return model


def rotate(model: nn.Module, ctx) -> nn.Module:
    """Stage: rotate with ``ctx.cfg.rotate`` = {kind, seed}."""
    r = ctx.cfg.get("rotate") or {}
    kind, seed = r.get("kind", "hadamard"), int(r.get("seed", 0))
    rotate_model(model, kind, seed, getattr(ctx, "device", None))
    ctx.record["rotation"] = {"kind": kind, "seed": seed, "order": model.config.hidden_size}
    return model
