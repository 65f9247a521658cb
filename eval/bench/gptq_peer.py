"""Our GPTQ beside a peer GPTQ on the same model, calibration tokens and evaluation: prints both
rows (ppl, KL and top-1 against the source, the log-gap of RTN closed when given).

The peer is llm-compressor's ``GPTQModifier`` (the GPTQ vLLM's users run; GPTQModel needs a newer
torch than this project's lock). It runs in its own environment, a venv with ``llmcompressor``
installed (``--peer-python``), on the calibration tokens our run used (``calib_samples``, same
seed), with the same bits, group size, dampening, block size and act-order; it writes a
compressed-tensors folder, which our loader reads and our evaluation scores on the same windows
as the run folder's own report (``compress.eval.perplexity.evaluate``).

    python -m venv /tmp/peer && /tmp/peer/bin/pip install llmcompressor==0.14.0.1
    python eval/bench/gptq_peer.py --ours outputs/gptq_int4 --peer-python /tmp/peer/bin/python
    python eval/bench/gptq_peer.py --ours RUN --peer-python P --small      # a smoke test

``--peer-observer`` picks how the peer sets each group's range: ``minmax`` (its default),
``mse`` (a shrink search, unweighted) or ``imatrix_mse`` (the shrink search weighted by the
inputs' E[x^2], the counterpart of our ``gptq.scale_search=mse``).

``--rtn-ppl`` (RTN's ppl at the same bits and windows) adds the log-gap closed,
``1 - ln(ppl / ppl_fp) / ln(ppl_rtn / ppl_fp)``.
"""

import argparse
import json
import math
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def peer_quantize(args) -> None:
    """In the peer's environment: llm-compressor's GPTQ of ``--source`` on ``--calib`` tokens."""
    import torch
    from datasets import Dataset
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import GPTQModifier
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ids = torch.load(args.calib)
    model = AutoModelForCausalLM.from_pretrained(args.source, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(args.source)
    weights = {"num_bits": args.bits, "type": "int", "symmetric": False, "strategy": "group"}
    weights.update(group_size=args.group_size, actorder="static" if args.act_order else None)
    weights.update(observer=args.observer)
    recipe = GPTQModifier(
        config_groups={"group_0": {"targets": ["Linear"], "weights": weights}},
        ignore=["lm_head"],
        dampening_frac=args.damp,
        block_size=args.block_size,
    )
    data = Dataset.from_dict(
        {"input_ids": ids.tolist(), "attention_mask": torch.ones_like(ids).tolist()}
    )
    start = time.time()
    oneshot(
        model=model,
        dataset=data,
        recipe=recipe,
        max_seq_length=ids.shape[1],
        num_calibration_samples=ids.shape[0],
        shuffle_calibration_samples=False,
        pipeline="sequential",
    )
    seconds = time.time() - start
    model.save_pretrained(args.out, save_compressed=True)
    tok.save_pretrained(args.out)
    (Path(args.out) / "peer.json").write_text(json.dumps({"gptq_s": seconds}))


def evaluate_folder(folder: Path, recipe: dict, source: dict) -> dict:
    """Our evaluation of ``folder`` on the windows ``recipe`` (a run's manifest recipe) names,
    against ``source`` (the manifest's: path and sha256)."""
    from compress.eval.perplexity import evaluate
    from compress.io.checkpoint import load_run
    from compress.io.data import eval_windows, read_text
    from compress.io.source import cache_dir, load_model

    model, tok = load_run(folder, verify=False)
    ev = recipe["eval"]
    windows = eval_windows(
        tok, read_text(recipe["data"]["eval"]["source"], role="eval"), ev["seqlen"], ev["windows"]
    )
    reference = load_model(source["path"])[0]
    cache = cache_dir() / "logprobs" if ev.get("cache_logprobs") else None
    return evaluate(model, windows, reference, cache=cache, source_sha=source["sha256"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--ours", help="our gptq run folder (its manifest names model, bits, data)")
    ap.add_argument("--peer-python", help="the python of a venv with llmcompressor")
    ap.add_argument("--out", default=None, help="the peer's folder (default: a temp)")
    ap.add_argument("--rtn-ppl", type=float, default=None, help="RTN's ppl, for the log-gap")
    ap.add_argument("--peer-observer", dest="observer", default="minmax",
                    choices=("minmax", "mse", "imatrix_mse"), help="the peer's weight observer")  # fmt: skip
    ap.add_argument("--small", action="store_true", help="4 calibration samples, 1 window")
    ap.add_argument("--peer", action="store_true", help=argparse.SUPPRESS)  # the peer's side
    for name, kind in (("source", str), ("calib", str), ("bits", int), ("group-size", int)):
        ap.add_argument(f"--{name}", type=kind, help=argparse.SUPPRESS)
    ap.add_argument("--damp", type=float, default=0.01, help=argparse.SUPPRESS)
    ap.add_argument("--block-size", type=int, default=128, help=argparse.SUPPRESS)
    ap.add_argument("--act-order", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.peer:
        return peer_quantize(args)

    import torch

    from compress.io.data import calib_samples, read_text
    from compress.io.tokenizer import load_tokenizer

    ours = Path(args.ours)
    manifest = json.loads((ours / "manifest.json").read_text())
    recipe, report = manifest["recipe"], json.loads((ours / "report.json").read_text())
    g = recipe["gptq"]
    if args.small:
        recipe["calib"].update(samples=4)
        recipe["eval"].update(windows=1)
    src_dir = manifest["source"]["path"]
    tok = load_tokenizer(Path(src_dir))
    calib = recipe["calib"]
    text = read_text(recipe["data"]["calib"]["source"], role="calib")
    ids = calib_samples(tok, text, calib["samples"], calib["seqlen"], seed=recipe["seed"])
    out = Path(args.out or tempfile.mkdtemp(prefix="gptq_peer-"))
    torch.save(ids, out.parent / f"{out.name}-calib.pt")
    argv = [args.peer_python, __file__, "--peer", "--source", str(src_dir), "--out", str(out)]
    argv += ["--calib", str(out.parent / f"{out.name}-calib.pt"), "--bits", str(report["bits"])]
    argv += ["--group-size", str(report["group_size"]), "--damp", str(g["damp"])]
    argv += ["--block-size", str(g["block_size"])] + (["--act-order"] if g["act_order"] else [])
    argv += ["--peer-observer", args.observer]
    subprocess.run(argv, check=True)
    peer = evaluate_folder(out, recipe, manifest["source"])
    peer_s = json.loads((out / "peer.json").read_text())["gptq_s"]
    if args.small:  # ours on the same single window
        ours_row = evaluate_folder(ours, recipe, manifest["source"])
    else:
        ours_row = report

    fp = report.get("source_ppl") or peer.get("source_ppl")
    rows = [
        ("compress gptq", ours_row, report["stages"].get("gptq")),
        ("llm-compressor", peer, peer_s),
    ]
    print(
        f"\n{report['bits']}-bit, group {report['group_size']}, act_order {g['act_order']}, "
        f"ours scale_search {g.get('scale_search', 'minmax')}, peer observer {args.observer}, "
        f"{recipe['eval']['windows']} windows of {recipe['eval']['seqlen']}; source ppl {fp:.3f}\n"
    )
    print("| GPTQ | ppl | KL vs source | top-1 vs source | log-gap closed | GPTQ s |")
    print("|---|---|---|---|---|---|")
    for name, r, seconds in rows:
        gap = ""
        if args.rtn_ppl and fp:
            gap = f"{1 - math.log(r['ppl'] / fp) / math.log(args.rtn_ppl / fp):.0%}"
        print(
            f"| {name} | {r['ppl']:.3f} | {r.get('kl_vs_source', float('nan')):.4f} | "
            f"{r.get('top1_vs_source', float('nan')):.4f} | {gap} | {seconds or float('nan'):.0f} |"
        )


if __name__ == "__main__":
    sys.exit(main())
