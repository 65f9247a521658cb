"""IAM's similarity and mapping (Zhao, Li and Zhao, ACL 2025, arXiv 2507.11953).

On calibration text (n samples of T tokens of WikiText-2 validation), each model's attention
weights ``A[l, h]`` (a T x T matrix, row t: query t's weights over keys <= t) are compared head by
head with the cosine similarity the paper picks among the measures it compares::

    cos(l, h; l', h') = mean_x  <A_L[l, h], A_S[l', h']>_F / (|A_L[l, h]|_F |A_S[l', h']|_F)

    layer map   m(l)      = argmax_l' sim(l, l'),   sim(l, l') = mean_h max_h' cos(l, h; l', h')
    head map    head(l, h) = argmax_h' cos(l, h; m(l), h')

Which large layers to map (``--iam-layers N``): the first N of ``order``, the large layers ranked
by ``sim(l, m(l))``, highest first, the first ``skip_first`` layers excluded (never mapped: an
error in a shallow layer reaches every later one; the count 2 is our choice, as is the ``auto``
rule, which maps the layers whose ``sim(l, m(l)) >= min_similarity``).

The mapping file (JSON) records both models' identities (config, tokenizer vocabulary and
embedding hashes), so that a file made for other models is refused by :func:`read_map`.
"""

import hashlib
import json
import logging
import os
from pathlib import Path

import torch
from tqdm import tqdm

from compress.decoder.model import load
from compress.errors import CompressError
from compress.io.checkpoint import read_tokenizer
from compress.io.data import calib_samples, read_text, wikitext_file
from compress.methods.iam.cache import RecordingCache

log = logging.getLogger(__name__)

FORMAT = "compress.methods.iam/1"
MAP_NAME = "iam_map.json"  # inside a run folder the pipeline wrote
SKIP_FIRST = 2
MIN_SIMILARITY = 0.8


def map_file(large) -> Path:
    """Where the mapping of ``large`` is: ``LARGE/iam_map.json`` (a pipeline run), else beside it."""
    large = Path(large)
    inside = large / MAP_NAME
    return inside if inside.is_file() else large.parent / f"{large.name}.iam.json"


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:16]


def identity(folder) -> dict:
    """What a mapping depends on: the architecture (config.json without its bookkeeping keys),
    the tokenizer's vocabulary and the embedding matrix, each hashed."""
    from safetensors import safe_open

    folder = Path(folder)
    raw = json.loads((folder / "config.json").read_text())
    arch = {k: v for k, v in raw.items() if k not in ("_name_or_path", "transformers_version")}
    embed = None
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            if "model.embed_tokens.weight" in st.keys():  # noqa: SIM118 (safe_open has no __contains__)
                embed = st.get_tensor("model.embed_tokens.weight").float().numpy().tobytes()
    if embed is None:
        raise CompressError(f"'{folder}' has no model.embed_tokens.weight in its safetensors.")
    return {
        "config_sha": _sha(json.dumps(arch, sort_keys=True).encode()),
        "vocab_sha": vocab_sha(folder),
        "embed_sha": _sha(embed),
        "layers": raw["num_hidden_layers"],
        "heads": raw["num_attention_heads"],
    }


def vocab_sha(folder) -> str:
    """A hash of the tokenizer's vocabulary (token -> id) in ``folder``."""

    tok = read_tokenizer(Path(folder))
    if tok is None:
        raise CompressError(
            f"'{folder}' has no tokenizer files; IAM maps models that share a tokenizer, so both "
            f"folders must carry theirs."
        )
    return _sha(json.dumps(sorted(tok.get_vocab().items())).encode())


def check_pair(large: dict, small: dict, large_name, small_name) -> None:
    """Refuse a small model whose tokenizer differs from the large model's."""
    if large["vocab_sha"] != small["vocab_sha"]:
        raise CompressError(
            f"IAM needs a small model with the large model's tokenizer: '{small_name}' has "
            f"another vocabulary than '{large_name}'. Map from a model of the same family "
            f"(e.g. a pruned copy: recipes/minitron_quarter.yaml)."
        )


def calibration(tokenizer, tokens: int, seqlen: int) -> torch.Tensor:
    """``[tokens // seqlen, seqlen]`` blocks of WikiText-2 validation (``compress.io.data``)."""

    if tokens < seqlen:
        raise CompressError(f"--tokens {tokens}: give at least one sample of {seqlen} tokens.")
    text = read_text(str(wikitext_file("wiki.valid.tokens")), role="calib")
    return calib_samples(tokenizer, text, tokens // seqlen, seqlen)


@torch.no_grad()
def attention_maps(model, ids: torch.Tensor) -> torch.Tensor:
    """Every layer's attention weights on one sequence ``ids [T]``: ``[layers, H, T, T]`` (fp32)."""

    n, T = model.spec.n_layers, ids.numel()
    cache = RecordingCache(
        model.kv_layout(), 1, T, torch.float32, model.device, keep=range(n), exact=True
    )
    model(ids[None].to(model.device), cache, last=True)
    return torch.stack([cache.heads_of(ly)[0].float().cpu() for ly in range(n)])


def _unit_rows(a: torch.Tensor) -> torch.Tensor:
    flat = a.reshape(a.shape[0] * a.shape[1], -1)
    return flat / flat.norm(dim=1, keepdim=True).clamp_min(1e-30)


@torch.no_grad()
def similarity(large, small, samples: torch.Tensor) -> torch.Tensor:
    """``cos [Ll, H, Ls, Hs]`` (float64): the mean over ``samples [n, T]`` of the cosine similarity
    of each large head's and each small head's attention weights (module docstring)."""
    total = None
    for ids in tqdm(samples, desc="iam similarity", unit="sample"):
        a, b = attention_maps(large, ids), attention_maps(small, ids)
        c = (_unit_rows(a) @ _unit_rows(b).T).double()
        c = c.view(a.shape[0], a.shape[1], b.shape[0], b.shape[1])
        total = c if total is None else total + c
    return total / samples.shape[0]


def choose(cos: torch.Tensor, skip_first: int = SKIP_FIRST) -> dict:
    """The layer and head maps and the ranking of large layers (module docstring) from ``cos``."""
    best_head = cos.max(dim=3)  # over small heads: [Ll, H, Ls]
    layer_sim = best_head.values.mean(dim=1)  # [Ll, Ls]
    sim, small = layer_sim.max(dim=1)
    heads = [best_head.indices[ly, :, small[ly]].tolist() for ly in range(cos.shape[0])]
    ranked = sorted(range(skip_first, cos.shape[0]), key=lambda ly: (-sim[ly].item(), ly))
    return {
        "layer_map": small.tolist(),
        "head_map": heads,
        "similarity": sim.tolist(),
        "head_similarity": [  # cos(l, h; m(l), head(l, h))
            best_head.values[ly, :, small[ly]].tolist() for ly in range(cos.shape[0])
        ],
        "layer_similarity": layer_sim.tolist(),
        "order": ranked,
        "skip_first": skip_first,
    }


def build_map(
    large,
    small,
    tokens: int = 4096,
    seqlen: int = 512,
    skip_first: int = SKIP_FIRST,
    min_similarity: float = MIN_SIMILARITY,
    dtype=torch.float32,
) -> dict:
    """The mapping of ``large`` onto ``small`` (folders) on ``tokens`` tokens of calibration text."""

    ident_l, ident_s = identity(large), identity(small)
    check_pair(ident_l, ident_s, large, small)
    if not 0 <= skip_first < ident_l["layers"]:
        raise CompressError(
            f"skip_first={skip_first}: the large model has {ident_l['layers']} layers."
        )
    large_model, tok = load(large, dtype=dtype)
    small_model, _ = load(small, dtype=dtype)
    samples = calibration(tok, tokens, seqlen)
    cos = similarity(large_model, small_model, samples)
    out = {"format": FORMAT, "large": ident_l, "small": ident_s, "small_path": str(small)}
    out.update(choose(cos, skip_first))
    out["min_similarity"] = min_similarity
    out["auto"] = [ly for ly in out["order"] if out["similarity"][ly] >= min_similarity]
    out["calibration"] = {"samples": int(samples.shape[0]), "seqlen": seqlen}
    return out


def save_map(mapping: dict, path) -> Path:
    """Write ``mapping`` to ``path`` (under a temporary name, then renamed) and its heat map beside
    it (``.png``, when matplotlib is installed)."""
    path = Path(path)
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(mapping, indent=1))
    tmp.replace(path)
    heatmap(mapping, path.with_suffix(".png"))
    return path


def heatmap(mapping: dict, path: Path) -> Path | None:
    """``sim(l, l')`` as an image, the chosen ``m(l)`` marked; None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log.warning("matplotlib is not installed: no heat map (pip install matplotlib)")
        return None
    sim = torch.tensor(mapping["layer_similarity"])
    fig, ax = plt.subplots(figsize=(1.5 + 0.25 * sim.shape[1], 1.5 + 0.2 * sim.shape[0]))
    im = ax.imshow(sim.numpy(), aspect="auto", cmap="viridis", origin="lower")
    ax.plot(mapping["layer_map"], range(sim.shape[0]), "rx", ms=4, label="m(l)")
    ax.set_xlabel("small-model layer")
    ax.set_ylabel("large-model layer")
    ax.set_title("IAM attention similarity (mean over heads of the best head)", fontsize=8)
    fig.colorbar(im, ax=ax)
    tmp = path.with_name(path.stem + f".tmp{os.getpid()}.png")
    fig.savefig(tmp, dpi=120, bbox_inches="tight")
    plt.close(fig)
    tmp.replace(path)
    return path


def read_map(path, large, small) -> dict:
    """The mapping at ``path``, refused unless it was made for these two folders."""
    path = Path(path)
    if not path.is_file():
        raise CompressError(
            f"no IAM mapping at '{path}'; make it with `python -m compress.cli.iam map --large "
            f"{large} --small {small}`."
        )
    try:
        m = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise CompressError(f"IAM mapping '{path}' is not valid JSON ({e}); make it again.")
    if m.get("format") != FORMAT:
        raise CompressError(f"'{path}' is not an IAM mapping file ({FORMAT}); make it again.")
    for role, folder in (("large", large), ("small", small)):
        have = identity(folder)
        if m[role] != have:
            diff = [k for k in have if m[role].get(k) != have[k]]
            raise CompressError(
                f"IAM mapping '{path}' was made for another {role} model than '{folder}' "
                f"(differs in {', '.join(diff)}); make it for these models with `python -m "
                f"compress.methods.iam map --large {large} --small {small} --out {path}`."
            )
    return m


def select(mapping: dict, layers) -> list[int]:
    """The large layers to map: ``"auto"``, or a count N (the first N of ``order``)."""
    if layers in (None, "auto"):
        return sorted(mapping["auto"])
    try:
        n = int(layers)
    except (TypeError, ValueError):
        raise CompressError(f"--iam-layers {layers!r}: give a number of layers or 'auto'.")
    if not 0 <= n <= len(mapping["order"]):
        raise CompressError(
            f"--iam-layers {n}: this mapping can map 0 to {len(mapping['order'])} layers (the "
            f"first {mapping['skip_first']} of {mapping['large']['layers']} are never mapped)."
        )
    return sorted(mapping["order"][:n])
