"""Sharded safetensors: write tensors one at a time (never a whole shard in memory), and find
which file of a folder holds each tensor.

A safetensors file (the format's spec)::

    u64 little-endian N | N bytes of JSON header, space-padded to 8 | the tensors' bytes
    header: {"NAME": {"dtype": "F32", "shape": [..], "data_offsets": [begin, end]}, ...,
             "__metadata__": {"format": "pt"}}       offsets relative to the end of the header

The header needs only each tensor's name, dtype and shape, so ``write_file`` writes it first and
then the tensors as their getters produce them. A folder of several files is written as
``save_pretrained`` does: ``model-00001-of-0000N.safetensors`` and ``model.safetensors.index.json``
(``{"metadata": {"total_size": BYTES}, "weight_map": {NAME: FILE}}``); one file is
``model.safetensors``. transformers and vLLM load both unchanged.
"""

import json
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from compress.errors import CompressError

WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"
MAX_SHARD_BYTES = 2 * 2**30  # 2 GiB a shard

_CODES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}


@dataclass
class Entry:
    """One tensor to write: its name, shape, dtype, and how to get it (called once, in order)."""

    name: str
    shape: tuple
    dtype: torch.dtype
    get: Callable[[], torch.Tensor]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def _bytes(t: torch.Tensor):
    """A tensor's bytes as a buffer, without a copy when it is contiguous on the CPU."""
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()


def write_file(path: Path, entries: list[Entry], metadata: dict | None = None) -> None:
    """Write ``entries`` into one safetensors file, holding one tensor at a time."""
    header, offset = {}, 0
    for e in entries:
        header[e.name] = {
            "dtype": _CODES[e.dtype],
            "shape": list(e.shape),
            "data_offsets": [offset, offset + e.nbytes],
        }
        offset += e.nbytes
    header["__metadata__"] = metadata or {"format": "pt"}
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for e in entries:
            t = e.get()
            if tuple(t.shape) != tuple(e.shape):
                raise CompressError(
                    f"tensor '{e.name}' has shape {tuple(t.shape)} when written, but "
                    f"{tuple(e.shape)} was announced; the model changed while it was saved."
                )
            f.write(_bytes(t.to(e.dtype)))
            del t


class TensorStream:
    """One ``[rows, ...]`` tensor of a safetensors file written in row chunks, in order; the file
    appears under ``path`` when ``close`` finds every row written."""

    def __init__(self, path: Path, name: str, shape: tuple, dtype: torch.dtype):
        self.path, self.tmp = Path(path), Path(path).with_suffix(f".{os.getpid()}.tmp")
        self.shape, self.dtype, self.rows = tuple(shape), dtype, 0
        nbytes = math.prod(shape) * dtype.itemsize
        header = {name: {"dtype": _CODES[dtype], "shape": list(shape), "data_offsets": [0, nbytes]}}
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.f = open(self.tmp, "wb")
        self.f.write(struct.pack("<Q", len(raw)) + raw)

    def write(self, chunk: torch.Tensor) -> None:
        self.f.write(_bytes(chunk.to(self.dtype)))
        self.rows += chunk.shape[0]

    def close(self) -> None:
        self.f.close()
        if self.rows == self.shape[0]:
            self.tmp.replace(self.path)
        else:
            self.tmp.unlink(missing_ok=True)


def plan_shards(entries: list[Entry], max_bytes: int) -> list[list[Entry]]:
    """Consecutive entries grouped into shards of at most ``max_bytes`` (a larger tensor alone)."""
    shards, size = [[]], 0
    for e in entries:
        if shards[-1] and size + e.nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(e)
        size += e.nbytes
    return shards


def write_sharded(
    folder: Path, entries: list[Entry], max_bytes: int = MAX_SHARD_BYTES
) -> list[str]:
    """Write ``entries`` into ``folder`` as ``save_pretrained`` lays them out; returns the files."""
    shards = plan_shards(entries, max_bytes)
    if len(shards) == 1:
        write_file(folder / WEIGHTS, shards[0])
        return [WEIGHTS]
    names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    weight_map = {}
    for name, shard in zip(names, shards):
        write_file(folder / name, shard)
        weight_map.update({e.name: name for e in shard})
    index = {"metadata": {"total_size": sum(e.nbytes for e in entries)}, "weight_map": weight_map}
    (folder / INDEX).write_text(json.dumps(index, indent=2, sort_keys=True))
    return names + [INDEX]


def weight_files(folder: Path) -> list[Path]:
    """The checkpoint's safetensors files: those the index names, else every ``*.safetensors``."""
    folder = Path(folder)
    if (folder / INDEX).is_file():
        weight_map = json.loads((folder / INDEX).read_text()).get("weight_map") or {}
        files = [folder / f for f in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise CompressError(
                f"'{folder}' lacks shard '{missing[0]}' that {INDEX} names; the folder is "
                f"incomplete: copy or download it again."
            )
        return files
    files = sorted(folder.glob("*.safetensors"))
    for f in files:  # a name matches, but a broken or looping symlink, or a folder, cannot be read
        if not f.is_file():
            try:
                f.stat()
                why = "not a file"
            except OSError as e:
                why = (e.strerror or str(e)).lower()
            raise CompressError(
                f"weights file '{f}' cannot be read ({why}): a broken or looping symlink, or not "
                f"a file. Put the real file there, or copy or download the checkpoint again."
            )
    return files


def tensor_files(folder: Path) -> dict[str, Path]:
    """``{tensor name: file}`` over a folder's safetensors files (reads headers only)."""
    out = {}
    for f in weight_files(folder):
        out.update({k: f for k in header(f)})
    return out


def read(files: dict[str, Path], names) -> dict[str, torch.Tensor]:
    """The tensors ``names``, each read from its file (``files``: ``tensor_files``)."""
    from safetensors import safe_open

    by_file = {}
    for n in names:
        by_file.setdefault(files[n], []).append(n)
    out = {}
    for f, group in by_file.items():
        with safe_open(str(f), framework="pt") as h:
            out.update({n: h.get_tensor(n) for n in group})
    return out


def header(path: Path) -> dict:
    """A file's ``{name: (shape, dtype)}`` from its header alone."""
    try:
        with open(path, "rb") as f:
            n = struct.unpack("<Q", f.read(8))[0]
            raw = json.loads(f.read(n))
        assert isinstance(raw, dict)
    except (struct.error, ValueError, AssertionError, MemoryError, OverflowError):
        raise CompressError(
            f"the safetensors file '{path}' is corrupt or truncated (its header does not "
            f"parse). Re-run the recipe that wrote it, or download the checkpoint again."
        ) from None
    codes = {v: k for k, v in _CODES.items()}
    return {
        k: (tuple(v["shape"]), codes[v["dtype"]]) for k, v in raw.items() if k != "__metadata__"
    }
