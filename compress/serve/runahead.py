"""KV-Runahead (Cho et al. 2024, arXiv 2405.05329): a prompt's prefill split across N processes.

Rank i owns the prompt's chunk ``[b_i, b_{i+1})``. Layer by layer it receives from rank i-1 the
K/V of every earlier token ``[0, b_i)``, appends its own, and hands ``[0, b_{i+1})`` on to rank
i+1, so the ranks run as a pipeline over the layers; the last rank ends with the whole KV cache
and the last token's logits. Each rank runs the decoder's one forward over its chunk with a
:class:`RunaheadCache`, the exact (``full``) cache that does the handing on, so the result is
that of a single-process prefill up to the order of floating-point sums.

Context-level load balancing: later chunks attend to more keys, so they are made shorter. With
``lin`` the linear FLOPs per token and ``att`` the attention FLOPs per query-key pair (all of a
layer), chunk ``[s, e)`` costs

    c(s, e) = lin (e - s) + att (e - s)(s + e + 1) / 2

and :func:`balanced_bounds` picks ``b_1 < ... < b_{N-1}`` so that every chunk costs ``c(0, T) / N``.

Processes talk over ``torch.distributed`` (gloo on the CPU). :class:`RunaheadPrefill` starts
N-1 helper processes once (ranks 0..N-2, each loading the run folder); the calling process is
the last rank, so the KV cache ends where decoding continues.
"""

import os
import socket

import torch
import torch.distributed as dist

from compress.decoder.kv import new_cache
from compress.decoder.model import load
from compress.errors import CompressError


def chunk_cost(model) -> tuple[float, float]:
    """``(lin, att)`` of the cost model from the config: FLOPs per token of a layer's linears,
    and per query-key pair of its attention (scores and weighted sum, every query head)."""
    s = model.spec
    H, G, d, D = s.n_heads, s.n_kv_heads, s.hidden_size, s.head_dim
    lin = 2 * (d * (H + 2 * G) * D + H * D * d + 3 * d * s.intermediate_size)
    return float(lin), float(4 * H * D)


def balanced_bounds(T: int, ranks: int, lin: float = 1.0, att: float = 0.0) -> list[int]:
    """``[0, b_1, ..., T]``: chunks of equal cost under the module docstring's model (``att`` 0:
    even chunks); each chunk at least one token."""
    if not 1 <= ranks <= T:
        raise CompressError(
            f"KV-Runahead needs between 1 and {T} (the prompt's tokens) prefill ranks, got {ranks}."
        )

    def cost(s, e):
        return lin * (e - s) + att * (e - s) * (s + e + 1) / 2

    target, bounds = cost(0, T) / ranks, [0]
    for i in range(1, ranks):
        s, lo, hi = bounds[-1], bounds[-1] + 1, T - (ranks - i)
        while lo < hi:  # the first end whose chunk reaches the target
            mid = (lo + hi) // 2
            lo, hi = (mid + 1, hi) if cost(s, mid) < target else (lo, mid)
        if lo > s + 1 and target - cost(s, lo - 1) < cost(s, lo) - target:
            lo -= 1  # the nearer of the two ends
        bounds.append(lo)
    return bounds + [T]


class RunaheadCache:
    """The ``full`` cache of one rank, receiving the earlier K/V before each layer's append and
    sending the K/V so far on after it."""

    def __init__(self, inner, rank: int, bounds: list[int], group=None):
        self.inner, self.rank, self.bounds, self.group = inner, rank, bounds, group
        self.last = rank == len(bounds) - 2
        self.sends = []

    @property
    def length(self) -> int:
        return self.inner.length

    def append(self, layer, k, v, pos=None):
        s, e = self.bounds[self.rank], self.bounds[self.rank + 1]
        if self.rank > 0:
            kp = torch.empty(k.shape[0], k.shape[1], s, k.shape[3], dtype=k.dtype)
            vp = (
                None
                if v is None
                else torch.empty(v.shape[0], v.shape[1], s, v.shape[3], dtype=v.dtype)
            )
            for t in (kp, vp):
                if t is not None:
                    dist.recv(t, self.rank - 1, group=self.group)
            self.inner.append(layer, kp, vp, torch.arange(s))
        self.inner.append(layer, k, v, pos)
        if not self.last:
            held = [self.inner.k[layer][:, :, :e]] + (
                [] if v is None else [self.inner.v[layer][:, :, :e]]
            )
            for t in held:
                t = t.to(k.dtype).contiguous()
                self.sends.append((dist.isend(t, self.rank + 1, group=self.group), t))

    def attend(self, layer, q, pos=None, start=None):
        return self.inner.attend(layer, q, pos, start)

    def wait(self) -> None:
        for work, _ in self.sends:
            work.wait()
        self.sends = []


@torch.no_grad()
def run_chunk(model, ids: torch.Tensor, bounds: list[int], rank: int, group=None):
    """Rank ``rank``'s part of the prefill of ``ids [T]``: ``(logits [1, 1, V], full cache)``."""
    s, e = bounds[rank], bounds[rank + 1]
    cache = RunaheadCache(new_cache(model, "full", 1, e), rank, bounds, group)
    logits = model(ids[None, s:e].to(model.device), cache, pos=torch.arange(s, e), last=True)
    cache.wait()
    return logits, cache.inner


def _helper(
    rank: int, world: int, port: int, folder: str, dtype: str, qdtype, threads: int
) -> None:

    torch.set_num_threads(threads)
    model, _ = load(  # the server verified the folder (or was told not to) before spawning
        folder,
        dtype=getattr(torch, dtype),
        qdtype=getattr(torch, qdtype) if qdtype else None,
        verify=False,
    )
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    try:
        while True:
            header = torch.zeros(1, dtype=torch.long)
            dist.broadcast(header, world - 1)
            if header.item() == 0:
                break
            ids, bounds = (
                torch.empty(header.item(), dtype=torch.long),
                torch.empty(world + 1, dtype=torch.long),
            )
            dist.broadcast(ids, world - 1)
            dist.broadcast(bounds, world - 1)
            run_chunk(model, ids, bounds.tolist(), rank)
    finally:
        dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RunaheadPrefill:
    """N-process prefill of ``model`` (loaded from ``folder`` with ``dtype`` and ``qdtype`` in the
    helpers too); this process is the last rank. ``balance``: "cost" (the module's model) or "even".
    """

    def __init__(
        self,
        model,
        folder,
        ranks: int,
        dtype: str = "float32",
        qdtype: str | None = None,
        threads: int = 1,
        balance: str = "cost",
    ):
        if ranks < 2:
            raise CompressError(
                f"KV-Runahead splits the prefill over 2 or more ranks, got {ranks}."
            )
        if balance not in ("cost", "even"):
            raise CompressError(f"KV-Runahead balance is 'cost' or 'even', not '{balance}'.")
        if model.device.type != "cpu":
            raise CompressError(
                "KV-Runahead hands K/V between processes over gloo, on the CPU; "
                "load the model on the CPU (NCCL for GPUs is not implemented)."
            )
        if model.kv_layout().windowed:
            raise CompressError(
                "KV-Runahead hands each rank the whole K/V so far; this model has sliding-"
                "window layers, whose caches keep only their window. Prefill it without "
                "KV-Runahead."
            )
        if dist.is_initialized():
            raise CompressError(
                "KV-Runahead needs this process's default process group, which is "
                "already initialized."
            )
        self.model, self.ranks, self.balance = model, ranks, balance
        port, ctx = free_port(), torch.multiprocessing.get_context("spawn")
        self.procs = [
            ctx.Process(
                target=_helper,
                args=(r, ranks, port, os.fspath(folder), dtype, qdtype, threads),
                daemon=True,
            )
            for r in range(ranks - 1)
        ]
        for p in self.procs:
            p.start()
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=ranks - 1, world_size=ranks
        )

    def bounds(self, T: int) -> list[int]:
        lin, att = chunk_cost(self.model)
        return balanced_bounds(T, self.ranks, lin, att if self.balance == "cost" else 0.0)

    def prefill(self, ids: list[int]):
        """``(logits [V] of the last token, full cache holding the prompt's K/V)``."""
        bounds = self.bounds(len(ids))
        t = torch.tensor(ids, dtype=torch.long)
        dist.broadcast(torch.tensor([len(ids)]), self.ranks - 1)
        dist.broadcast(t, self.ranks - 1)
        dist.broadcast(torch.tensor(bounds), self.ranks - 1)
        logits, cache = run_chunk(self.model, t, bounds, self.ranks - 1)
        return logits[0, -1], cache

    def close(self) -> None:
        if dist.is_initialized():
            dist.broadcast(torch.zeros(1, dtype=torch.long), self.ranks - 1)
            dist.destroy_process_group()
        for p in self.procs:
            p.join(30)
