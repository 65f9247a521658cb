"""AWQ/RTN time and peak memory, and distillation tokens/s and MFU, on models built from configs.

Every model is random (timing and memory do not depend on the values), written by this script
as a bfloat16 safetensors folder (one tensor at a time: the whole model is never in memory)
with SmolLM2's tokenizer, so nothing downloads. Shapes (``SHAPES``): SmolLM2-135M,
Qwen2.5-0.5B (untied head), a 1.5B Qwen2 (Qwen2-1.5B's config) and Llama-2-7B. AWQ's time is
linear in the layers, so ``--layers N`` builds N decoder layers of a shape and the table scales
the stage time by ``layers / N`` (the rows say so); memory is that of the N-layer model
(``RSS / fp32``: over the N-layer model's float32 size; ``RSS / full fp32``: over the full
shape's, the figure that carries over, since a disk-backed run holds one layer at a time).

Each measurement is a fresh ``python -m compress`` process (its ``report.json`` gives the stage
seconds, ``peak_rss_bytes`` and, on a GPU, ``peak_device_bytes``); peak RSS is also reported
relative to the full model's float32 size (``fp32``).

    # the host-memory rows (CPU)
    python eval/bench/bench_scale.py --rows rtn:qwen2.5-0.5b awq:qwen2-1.5b --device cpu \\
        --calib-samples 8
    # the device table (about 8 minutes on an H200)
    python eval/bench/bench_scale.py --gpu
    # quick check at tiny sizes
    python eval/bench/bench_scale.py --quick

Distillation rows (``distill:SHAPE``) run ``python -m compress.cli.distill`` with the model as
its own teacher for ``--distill-tokens`` tokens and read tokens/s from ``distill.json``;
MFU = tok/s x (6 N + 2 N) / ``--peak-tflops`` (teacher forward 2N, student forward and
backward 6N, N the parameters without the embedding).
"""

import argparse
import json
import math
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

SHAPES = {
    "tiny": dict(
        family="qwen2",
        hidden_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=256,
        vocab_size=49152,
        tie_word_embeddings=False,
    ),
    "smollm2-135m": dict(
        family="llama",
        hidden_size=576,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        intermediate_size=1536,
        vocab_size=49152,
        tie_word_embeddings=True,
    ),
    "qwen2.5-0.5b": dict(
        family="qwen2",
        hidden_size=896,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        intermediate_size=4864,
        vocab_size=151936,
        tie_word_embeddings=False,
    ),
    "qwen2-1.5b": dict(
        family="qwen2",
        hidden_size=1536,
        num_hidden_layers=28,
        num_attention_heads=12,
        num_key_value_heads=2,
        intermediate_size=8960,
        vocab_size=151936,
        tie_word_embeddings=True,
    ),
    "llama-7b": dict(
        family="llama",
        hidden_size=4096,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=32,
        intermediate_size=11008,
        vocab_size=32000,
        tie_word_embeddings=False,
    ),
}


def hf_config(shape: str, layers: int | None = None):
    from transformers import LlamaConfig, Qwen2Config

    kw = dict(SHAPES[shape])
    family = kw.pop("family")
    if layers:
        kw["num_hidden_layers"] = layers
    cls = Qwen2Config if family == "qwen2" else LlamaConfig
    return cls(max_position_embeddings=4096, rope_theta=10000.0, **kw)


def n_params(config) -> int:
    """Parameters of the model of ``config`` (a tied head once)."""
    from compress.io.offload import empty_model

    model = empty_model(config)
    tied = getattr(config, "tie_word_embeddings", False)
    return sum(
        p.numel() for n, p in model.named_parameters() if not (tied and n == "lm_head.weight")
    )


def make_model(folder: Path, shape: str, layers: int | None = None, seed: int = 0) -> Path:
    """A random bfloat16 HF folder of ``shape`` (weights N(0, 0.02), norms 1), written one
    tensor at a time, with SmolLM2's tokenizer; reused when it exists."""
    from transformers import AutoTokenizer

    from compress.io.offload import empty_model
    from compress.io.shards import Entry, write_sharded
    from compress.io.source import convert_default_model

    if (folder / "config.json").is_file():
        return folder
    config = hf_config(shape, layers)
    model = empty_model(config, torch.bfloat16)
    sd = model.state_dict()
    if config.tie_word_embeddings:
        sd.pop("lm_head.weight", None)
    gen = torch.Generator().manual_seed(seed)

    def value(name, t):
        if name.endswith("norm.weight"):
            return torch.ones(t.shape, dtype=torch.bfloat16)
        return (torch.randn(t.shape, generator=gen) * 0.02).to(torch.bfloat16)

    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    entries = [
        Entry(k, tuple(t.shape), torch.bfloat16, lambda k=k, t=t: value(k, t))
        for k, t in sd.items()
    ]
    write_sharded(tmp, entries)
    config.dtype = "bfloat16"
    config.save_pretrained(tmp)
    AutoTokenizer.from_pretrained(convert_default_model()).save_pretrained(tmp)
    tmp.rename(folder)
    return folder


def run_recipe(recipe: str, folder: Path, out: Path, overrides: list[str]) -> dict:
    cmd = [
        sys.executable,
        "-m",
        "compress",
        f"recipe={recipe}",
        f"model.path={folder}",
        f"hydra.run.dir={out}",
        "decode.enabled=false",
        *overrides,
    ]
    t = time.time()
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{done.stderr[-3000:]}")
    report = json.loads((out / "report.json").read_text())
    report["wall_s"] = time.time() - t
    return report


def distill_row(folder: Path, out: Path, tokens: int, device: str, peak_tflops: float | None):
    import os

    from compress.io.data import read_text

    text = out.parent / "distill.txt"
    if not text.exists():
        valid = Path(os.environ.get("COMPRESS_DATA_DIR", "")) / "wikitext-2" / "wiki.valid.tokens"
        text.write_text(read_text(str(valid), role="distill"))
    cmd = [
        sys.executable,
        "-m",
        "compress.methods.distill.distill",
        "--student",
        str(folder),
        "--teacher",
        str(folder),
        "--data",
        str(text),
        "--tokens",
        str(tokens),
        "--out",
        str(out),
        "--no-progress",
    ]
    env = None
    if device == "cpu":
        env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    done = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if done.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{done.stderr[-3000:]}")
    return json.loads((out / "distill.json").read_text())


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", nargs="+", help="METHOD:SHAPE[:LAYERS], METHOD rtn, awq or distill")
    p.add_argument("--device", default="auto", help="the recipes' device (auto, cpu, cuda)")
    p.add_argument("--calib-samples", type=int, default=128)
    p.add_argument("--windows", type=int, default=1, help="eval.windows of each run")
    p.add_argument("--distill-tokens", type=int, default=65536)
    p.add_argument(
        "--peak-tflops",
        type=float,
        default=None,
        help="the device's dense bf16 peak for MFU (H100/H200 SXM: 989)",
    )
    p.add_argument("--set", nargs="*", default=[], help="extra recipe overrides, e.g. awq.n_grid=2")
    p.add_argument("--work", type=Path, default=None, help="folder for models and runs (kept)")
    p.add_argument("--quick", action="store_true", help="tiny shapes on the CPU, seconds")
    p.add_argument("--gpu", action="store_true", help="the device table (about 8 min, H200)")
    args = p.parse_args(argv)
    if args.quick:
        args.rows = args.rows or ["rtn:tiny", "awq:tiny", "distill:tiny"]
        args.calib_samples, args.distill_tokens, args.device = 4, 1024, "cpu"
    elif args.gpu:
        args.device = "cuda"
        args.peak_tflops = args.peak_tflops or 989.0
        args.rows = args.rows or [
            "awq:smollm2-135m",
            "awq:qwen2.5-0.5b",
            "awq:qwen2-1.5b",
            "awq:llama-7b:8",
            "distill:smollm2-135m",
        ]
        args.distill_tokens = max(args.distill_tokens, 1_048_576)
    if not args.rows:
        p.error("give --rows, --quick or --gpu")
    work = args.work or Path(tempfile.mkdtemp(prefix="bench_scale-"))
    work.mkdir(parents=True, exist_ok=True)
    rows = []
    for spec in args.rows:
        method, shape, *rest = spec.split(":")
        layers = int(rest[0]) if rest else None
        full = hf_config(shape)
        folder = make_model(work / f"{shape}{f'-L{layers}' if layers else ''}", shape, layers)
        fp32 = 4 * n_params(full)
        scale = full.num_hidden_layers / layers if layers else 1.0
        out = work / f"run-{method}-{shape}-{layers or 'all'}-{len(rows)}"
        shutil.rmtree(out, ignore_errors=True)
        if method == "distill":
            stats = distill_row(folder, out, args.distill_tokens, args.device, args.peak_tflops)
            cfg = hf_config(shape, layers)
            body = n_params(cfg) - cfg.vocab_size * cfg.hidden_size * (
                1 if cfg.tie_word_embeddings else 2
            )
            tok_s = stats.get("tok_s")
            mfu = (
                tok_s * 8 * body / (args.peak_tflops * 1e12) if tok_s and args.peak_tflops else None
            )
            rows.append(dict(row=spec, tok_s=tok_s, mfu=mfu))
            continue
        recipe = {"rtn": "rtn_int4", "awq": "awq_int4"}[method]
        overrides = [
            f"device={args.device}",
            f"eval.windows={args.windows}",
            f"calib.samples={args.calib_samples}",
            *args.set,
        ]
        rep = run_recipe(recipe, folder, out, overrides)
        stage = rep["stages"].get(method, float("nan"))
        rows.append(
            dict(
                row=spec,
                params=n_params(full),
                fp32_gb=fp32 / 1e9,
                stage_s=stage * scale,
                scaled=f"x{scale:g} ({layers} of {full.num_hidden_layers} layers)"
                if layers
                else "",
                wall_s=rep["wall_s"],
                peak_rss_gb=rep["peak_rss_bytes"] / 1e9,
                rss_over_fp32=rep["peak_rss_bytes"] / (4 * n_params(hf_config(shape, layers))),
                rss_over_full=rep["peak_rss_bytes"] / fp32,
                peak_device_gb=rep.get("peak_device_bytes", 0) / 1e9,
                offload=rep.get("offload"),
                ppl=rep.get("ppl"),
            )
        )
    print(
        f"device={args.device} calib.samples={args.calib_samples} eval.windows={args.windows} "
        f"{' '.join(args.set)}"
    )
    print(
        "| row | params | fp32 GB | stage s | wall s | peak RSS GB | RSS / fp32 | RSS / full fp32 "
        "| peak device GB | offload | note |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        if "tok_s" in r:
            mfu = f"MFU {r['mfu']:.1%}" if r["mfu"] is not None else "MFU: give --peak-tflops"
            print(f"| {r['row']} | | | | | | | | | | {r['tok_s']} tok/s, {mfu} |")
            continue
        print(
            f"| {r['row']} | {r['params'] / 1e6:.0f}M | {r['fp32_gb']:.2f} | {r['stage_s']:.1f} | "
            f"{r['wall_s']:.0f} | {r['peak_rss_gb']:.2f} | {r['rss_over_fp32']:.2f} | "
            f"{r['rss_over_full']:.2f} | "
            f"{r['peak_device_gb']:.2f} | {r['offload']} | {r['scaled']} |"
        )
    if not math.isfinite(sum(r.get("stage_s", 0) for r in rows)):
        print("(a stage time is missing)")


if __name__ == "__main__":
    main()
