"""The KV pools' memory, checked against what the machine has before they are allocated.

The pools (``compress.decoder.kv.paged.PagedCache``) hold, for each cache slot ``l`` in window
group ``g(l)``, ``blocks[g] * block_size`` rows of ``n_kv_heads`` heads; the block manager keeps
a few Python objects per block on the host:

    device bytes = sum over slots l of blocks[g(l)] * block_size * n_kv_heads * width * itemsize
    width        = head_dim when V is K's first channels (v_dim), else 2 * head_dim (K and V)
    host bytes   = HOST_BYTES_PER_BLOCK * sum over groups of blocks[g]

Available memory: the free memory of the GPU (``torch.cuda.mem_get_info``); on the CPU the
kernel's ``MemAvailable``, or less when a cgroup (a container) caps this process. Unknown
(another OS, another device): not checked.
"""

import os
from pathlib import Path

import torch

from compress.decoder.kv.base import KVLayout
from compress.errors import CompressError

HOST_BYTES_PER_BLOCK = 64  # reference count, hash, free-list entry and its int object


def pool_bytes(layout: KVLayout, groups: list, sizes: list[int], block_size: int, itemsize: int):
    """``(device bytes, host bytes)`` of pools of ``sizes[g]`` blocks for window ``groups[g]``
    (``window_groups`` of ``layout.windows``), the formula of the module docstring."""
    width = layout.head_dim if layout.v_dim else 2 * layout.head_dim
    row = block_size * layout.n_kv_heads * width * itemsize
    device = sum(sizes[groups.index(w)] * row for w in layout.slot_windows())
    return device, HOST_BYTES_PER_BLOCK * sum(sizes)


def host_available() -> int | None:
    """Bytes this process may still allocate on the host, or None when unknown."""
    found = []
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                found.append(int(line.split()[1]) * 1024)
    except (OSError, ValueError, IndexError):
        pass
    try:  # cgroup v2: the container's limit less what it uses
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit != "max":
            used = int(Path("/sys/fs/cgroup/memory.current").read_text())
            found.append(max(0, int(limit) - used))
    except (OSError, ValueError):
        pass
    if not found and hasattr(os, "sysconf"):
        try:
            found.append(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
        except (OSError, ValueError):
            pass
    return min(found) if found else None


def device_available(device: torch.device) -> int | None:
    if device.type == "cpu":
        return host_available()
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    return None


def gib(n: int) -> str:
    return f"{n / (1 << 30):,.1f} GiB" if n >= 1 << 28 else f"{n / (1 << 20):,.1f} MiB"


def check_pool_memory(model, groups: list, sizes: list[int], block_size: int, kind: str) -> None:
    """Refuse the pools ``new_paged_cache(model, sizes, block_size, kind)`` would allocate when
    they do not fit in the memory the device (and the host) has free now, the model loaded;
    the message names the most blocks that would fit."""
    device = model.device
    on_cpu = device.type == "cpu"
    itemsize = 2 if kind == "fp16" else 4 if on_cpu else model.dtype.itemsize  # as the cache
    kv, host = pool_bytes(model.kv_layout(), groups, sizes, block_size, itemsize)
    checks = [(kv + host if on_cpu else kv, device_available(device), str(device))]
    if not on_cpu:
        checks.append((host, host_available(), "the host"))
    for need, free, where in checks:
        if free is not None and need > free:
            fit = sizes[0] * free // need
            raise CompressError(
                f"a KV pool of {sizes[0]:,} blocks of {block_size} tokens (--num-blocks, "
                f"--block-size) needs {gib(need)} on {where}, which has {gib(free)} free; "
                + (
                    f"give --num-blocks {fit:,} or fewer (or a smaller --block-size)."
                    if fit >= 1
                    else "not one block fits: free memory, or serve on another device."
                )
            )
