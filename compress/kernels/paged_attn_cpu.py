"""Batch-invariant attention over the paged KV cache (``paged_attn_cpu.cpp``): a request's
attention does not depend on what else is in the batch.

Torch's fused attention reduces over keys and channels in an order that follows the shapes
(the batch's longest context, the step's query count, the kernel's blocking), so the same query
gets other low bits in another batch, and a greedy decode can part. Here every query is computed
alone, in one order fixed by its own keys (as vLLM's batch-invariant mode fixes its kernels'
reduction orders)::

    n = visible keys of query (b, t):  min(len_b, pos[t] - start[b] + 1)   (``kv/paged.py``)
    s_j = scale q . K_b[j]  (8 lanes over channels, a fixed tree)    j = 0 .. n-1
    out = sum_j exp(s_j - max s) V_b[j] / sum_j exp(s_j - max s)     (sums in j order)

With attention sinks (gpt-oss: a logit z_h per query head for a key whose value is 0) the max
also takes z_h and the denominator adds exp(z_h - max): ``out = sum_j exp(s_j) V_j / (exp(z_h)
+ sum_j exp(s_j))``.

in fp32 from the pool's fp16 or fp32 K/V; one thread per (row, head), so the thread count does
not change it either. :func:`attention` is the same product in float64 PyTorch for tests
(``reference``). With the integer W4A8 linears (exact whatever the rows) the whole forward of a
row is then the same alone as in any batch.
"""

import os

import torch

import compress.kernels.native as native


def visible(lens: torch.Tensor, pos: torch.Tensor, start: torch.Tensor) -> torch.Tensor:
    """``[B, T]`` int64: how many keys (from key 0) query column ``t`` of row ``b`` sees."""
    hi = torch.minimum(lens[:, None], pos[None, :] - start[:, None] + 1)
    return hi.clamp_min(0).contiguous()


def sink_logits(sinks: torch.Tensor | None, H: int) -> torch.Tensor | None:
    """``sinks`` as the kernels read them: a contiguous float32 ``[H]``, or None."""
    if sinks is None:
        return None
    if sinks.numel() != H:
        raise ValueError(f"attention sinks: one logit per query head ({H}), not {sinks.numel()}")
    return sinks.detach().reshape(H).float().contiguous()


def attention(q, k_pool, v_pool, gather, hi, scale: float, out=None, sinks=None) -> torch.Tensor:
    """``[B, H, T, Dv]`` fp32: ``q [B, H, T, D]`` against pools ``[slots, Hkv, D]`` (``v_pool``
    may be a view of ``k_pool``'s first channels), keys of row b at slots ``gather [B, L]``.

    The kernel writes every element of its output, whatever the buffer held before: a query with
    no visible key (``hi[b, t] <= 0``, padding) gives zeros. The output is a new uninitialized
    tensor, or ``out`` (contiguous fp32 CPU ``[B, H, T, Dv]``, e.g. a NaN-filled buffer in tests,
    which then holds no NaN). ``sinks``: None, or the ``[H]`` sink logits."""
    lib = native.library()
    B, H, T, D = q.shape
    sinks = sink_logits(sinks, H)
    Hkv, Dv = k_pool.shape[1], v_pool.shape[2]
    q = q.float().contiguous()
    gather, hi = gather.contiguous(), hi.contiguous()  # held until the call returns
    if out is None:
        out = torch.empty(B, H, T, Dv, dtype=torch.float32)
    elif not (
        out.shape == (B, H, T, Dv)
        and out.dtype == torch.float32
        and out.device.type == "cpu"
        and out.is_contiguous()
    ):
        raise ValueError(
            f"paged attention writes a contiguous float32 CPU out of shape {(B, H, T, Dv)}, "
            f"not {out.dtype} {tuple(out.shape)} on {out.device}"
        )
    half = k_pool.dtype == torch.float16
    if k_pool.dtype not in (torch.float16, torch.float32) or v_pool.dtype != k_pool.dtype:
        raise ValueError(f"paged attention reads fp16 or fp32 pools, not {k_pool.dtype}")
    lib.paged_attention(
        q.data_ptr(), out.data_ptr(), k_pool.data_ptr(), v_pool.data_ptr(),
        k_pool.stride(0), k_pool.stride(1), v_pool.stride(0), v_pool.stride(1),
        gather.data_ptr(), hi.data_ptr(),
        B, H, Hkv, T, gather.shape[1], D, Dv, float(scale),
        None if sinks is None else sinks.data_ptr(), int(half), torch.get_num_threads(),
    )  # fmt: skip
    return out


_FAKE: dict = {}


def takes_cache(k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether :func:`cache_attention` can read this contiguous cache's ``k``/``v``: fp16 or
    fp32 CPU tensors with unit channel stride, and the C++ operators built (``native.ops()``)."""
    ok = (
        k.device.type == "cpu"
        and k.dtype in (torch.float16, torch.float32)
        and v.dtype == k.dtype
        and k.stride(-1) == 1
        and v.stride(-1) == 1
        and os.environ.get("COMPRESS_KERNELS") not in ("ref", "eager")
        and native.ops()
    )
    if ok and not _FAKE:
        _FAKE["cache_attention"] = torch.library.register_fake("compress::cache_attention")(
            lambda q, k, v, lo, hi, scale, sinks=None: q.new_empty(
                *q.shape[:3], v.shape[-1], dtype=torch.float32
            )
        )
    return ok


def cache_attention(q, k, v, lo, hi, scale: float, sinks=None) -> torch.Tensor:
    """``[B, H, Tq, Dv]`` fp32: the same fixed-order attention over a contiguous cache ``k [B,
    Hkv, L, D]``, ``v [B, Hkv, L, Dv]`` (fp16 or fp32), query ``(b, t)`` seeing slots ``lo[b, t]
    .. hi[b, t] - 1`` (``int64 [B, Tq]``), through the C++ operator ``compress::cache_attention``
    (the static compiled decode step: no fp32 copy of the cache per layer and step); ``sinks``
    as :func:`attention`'s."""
    if not _FAKE and not takes_cache(k, v):  # loads the operators (and their fake shapes)
        raise ValueError("cache_attention reads fp16 or fp32 CPU caches once the operators build")
    return torch.ops.compress.cache_attention(
        q, k, v, lo, hi, scale, sink_logits(sinks, q.shape[1])
    )


def reference(q, k_pool, v_pool, gather, hi, scale: float, sinks=None) -> torch.Tensor:
    """The same product in float64, query by query (tests); ``sinks`` as :func:`attention`'s."""
    B, H, T, _ = q.shape
    group = H // k_pool.shape[1]
    out = torch.zeros(B, H, T, v_pool.shape[2], dtype=torch.float64)
    for b in range(B):
        for t in range(T):
            n = int(hi[b, t])
            if n <= 0:
                continue
            keys = k_pool[gather[b, :n]].double()  # [n, Hkv, D]
            vals = v_pool[gather[b, :n]].double()
            for h in range(H):
                s = keys[:, h // group] @ q[b, h, t].double() * scale
                if sinks is None:
                    out[b, h, t] = torch.softmax(s, 0) @ vals[:, h // group]
                    continue
                z = torch.cat([s, sinks[h].double().view(1)])  # the sink: a key of value 0
                out[b, h, t] = torch.softmax(z, 0)[:-1] @ vals[:, h // group]
    return out
