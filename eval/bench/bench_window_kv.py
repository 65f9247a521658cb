"""KV bytes per token of a model with local (sliding-window) layers at a long prompt, against the
same model with every layer global: analytic and measured from the cache.

    python eval/bench/bench_window_kv.py [--folder FOLDER] [--prompt-tokens 8000]
        [--kvs fp16 kivi packkv] [--json OUT]

``FOLDER`` defaults to Gemma 3 270M (``model=gemma3-270m``, converted from its GGUF package).
The prompt is the first ``--prompt-tokens`` tokens of WikiText-2 test (``COMPRESS_DATA_DIR``).
Analytic bytes for a prompt of ``T`` tokens, fp16 K and V::

    KV(T) = sum_layers min(T, window_l) * 2 * kv_heads * head_dim * 2 bytes      (window_l = T: global)

Measured: ``cache.nbytes() / T`` of ``compress.decoder``'s cache after the prefill and four
greedy tokens (``generate``; the cache holds ``T + 4`` slots). "All global" runs the same weights
with ``layer_types`` set to ``full_attention`` on every layer (a folder of links with that
config.json), so only the windows differ; its logits are not the model's.
"""

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

from compress.arch.spec import spec_of
from compress.decoder.generate import generate
from compress.decoder.model import load
from compress.io.checkpoint import read_config

NEW = 4


def analytic(spec, tokens: int, bytes_per: int = 2) -> float:
    """Bytes per token of fp16 K and V after ``tokens`` tokens (the formula above)."""
    per_slot = 2 * spec.n_kv_heads * spec.head_dim * bytes_per
    return sum(min(tokens, layer.window or tokens) * per_slot for layer in spec.layers) / tokens


def all_global(folder: Path, into: Path) -> Path:
    """``into``: links to ``folder``'s files, config.json with every layer global."""
    into.mkdir(parents=True, exist_ok=True)
    for f in folder.iterdir():
        if f.name != "config.json":
            (into / f.name).symlink_to(f.resolve())
    cfg = json.loads((folder / "config.json").read_text())
    cfg["layer_types"] = ["full_attention"] * cfg["num_hidden_layers"]
    cfg["use_sliding_window"] = False
    (into / "config.json").write_text(json.dumps(cfg, indent=2))
    return into


def prompt_ids(tokenizer, n: int) -> list[int]:
    data = Path(os.environ.get("COMPRESS_DATA_DIR", "../shared/data"))
    text = (data / "wikitext-2" / "wiki.test.raw").read_text(encoding="utf-8")
    ids = tokenizer(text[: n * 12])["input_ids"][:n]
    if len(ids) < n:
        sys.exit(f"WikiText-2 test gave {len(ids)} tokens, fewer than --prompt-tokens {n}")
    return ids


def measure(folder: Path, kv: str, ids: list[int]) -> float:
    model, _ = load(folder)
    r = generate(model, [ids], NEW, kv=kv, ignore_eos=True)
    return r.kv_bytes / len(ids)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--folder", type=Path, default=None, help="default: Gemma 3 270M")
    p.add_argument("--prompt-tokens", type=int, default=8000)
    p.add_argument("--kvs", nargs="+", default=["fp16"], help="fp16, kivi, packkv")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    if args.folder is None:
        from compress.io.source import convert_embedded

        args.folder = Path(convert_embedded("gemma3-270m"))
    spec = spec_of(read_config(args.folder)[0])
    T = args.prompt_tokens
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        glob = all_global(args.folder, Path(tmp) / "all-global")
        gspec = spec_of(read_config(glob)[0])
        _, tok = load(args.folder)
        ids = prompt_ids(tok, T)
        for kv in args.kvs:
            local, full = measure(args.folder, kv, ids), measure(glob, kv, ids)
            rows.append(dict(kv=kv, measured=local, measured_all_global=full))
    a, ag = analytic(spec, T), analytic(gspec, T)
    windows = sorted({layer.window for layer in spec.layers if layer.window})
    n_local = sum(1 for layer in spec.layers if layer.window)
    print(
        f"{args.folder.name}: {len(spec.layers)} layers, {n_local} local (window "
        f"{', '.join(map(str, windows))}), {spec.n_kv_heads} KV heads x {spec.head_dim}; "
        f"prompt {T} tokens + {NEW} new\n"
    )
    print("| cache | KV B/token | all global | ratio |")
    print("|---|---|---|---|")
    print(f"| analytic (fp16) | {a:.0f} | {ag:.0f} | {a / ag:.3f} |")
    for r in rows:
        print(
            f"| measured {r['kv']} | {r['measured']:.0f} | {r['measured_all_global']:.0f} | "
            f"{r['measured'] / r['measured_all_global']:.3f} |"
        )
    if args.json:
        args.json.write_text(
            json.dumps(dict(tokens=T, analytic=a, analytic_all_global=ag, rows=rows), indent=2)
        )


if __name__ == "__main__":
    main()
