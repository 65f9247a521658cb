"""Our GPTQ beside a peer GPTQ on the same model, calibration tokens and evaluation: prints both
rows (ppl, KL and top-1 against the source, the log-gap of RTN closed when given).

The peer (``--peer``) is llm-compressor's ``GPTQModifier`` (``llmcompressor``, the default: the
GPTQ vLLM's users run) or GPTQModel's GPTQ (``gptqmodel``). Each runs in its own environment, a venv
with the peer installed (``--peer-python``; both need a torch other than this project's lock), on
the calibration tokens our run used (``calib_samples``, same seed), with the same bits, group size,
dampening, block size and act-order, asymmetric, true-sequential. llm-compressor writes a
compressed-tensors folder; GPTQModel's packed GPTQ layers are unpacked (scales * (q - zeros), in
float32) into a plain float HF folder holding exactly its grid values, checked to hold at most
2^bits values per group and to match GPTQModel's own dequantization. Our loader reads either
folder and our evaluation scores it on the same windows as the run folder's own report
(``compress.eval.perplexity.evaluate``).

    python -m venv /tmp/peer && /tmp/peer/bin/pip install llmcompressor==0.14.0.1
    python eval/bench/gptq_peer.py --ours outputs/gptq_int4 --peer-python /tmp/peer/bin/python
    python eval/bench/gptq_peer.py --ours RUN --peer-python P --small      # a smoke test

    python -m venv /tmp/gpm-venv && /tmp/gpm-venv/bin/pip install torch==2.14.1 gptqmodel==7.7.0
    python eval/bench/gptq_peer.py --ours outputs/gptq_int4 --peer gptqmodel \
        --peer-python /tmp/gpm-venv/bin/python

GPTQModel runs paper GPTQ on the CPU: its extras are off (group-aware reordering, the RTN fallback
of modules with little calibration, damp auto-increment, GPTAQ/FOEM, rotation, smoothing); its
packed scales are float16, as its checkpoints store them.

``--peer-observer`` picks how the peer sets each group's range: ``minmax`` (its default),
``mse`` (a shrink search, unweighted) or ``imatrix_mse`` (the shrink search weighted by the
inputs' E[x^2], the counterpart of our ``gptq.scale_search=mse``; llm-compressor only).

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


def peer_gptqmodel(args) -> None:
    """In GPTQModel's environment: its GPTQ of ``--source`` on ``--calib`` tokens, on the CPU,
    written as a float HF folder of its dequantized weights."""
    import os

    # its CPU thread pool wants 2 workers at least (its default is half the cores)
    os.environ.setdefault("GPTQMODEL_CPU_WORKERS", str(max(2, ((os.cpu_count() or 1) + 1) // 2)))
    import torch
    from gptqmodel import GPTQModel
    from gptqmodel.nn_modules.qlinear import PackableQuantLinear
    from gptqmodel.quantization.config import GPTQConfig
    from gptqmodel.quantization.gptq import GPTQ
    from gptqmodel.utils.model import convert_gptq_v1_to_v2_format_module
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if args.observer == "imatrix_mse":
        raise SystemExit("GPTQModel has no input-weighted range search (imatrix_mse)")
    GPTQ.quantize.__defaults__ = (args.block_size,)  # its processor calls quantize() bare
    ids = torch.load(args.calib)
    if Path(args.source).exists():
        args.source = str(Path(args.source).resolve())
    args.out = Path(args.out).resolve()
    args.out.mkdir(parents=True, exist_ok=True)
    os.chdir(args.out)  # it writes its logs to ./logs
    qcfg = GPTQConfig(
        bits=args.bits, group_size=args.group_size, sym=False, true_sequential=True,
        desc_act=args.act_order, static_groups=args.act_order, act_group_aware=False,
        damp_percent=args.damp, damp_auto_increment=0.0, mse=2.0 if args.observer == "mse" else 0.0,
        fallback=None, offload_to_disk=False, device="cpu",
    )  # fmt: skip
    model = GPTQModel.load(args.source, qcfg, dtype=torch.float32)
    rows = [{"input_ids": r, "attention_mask": [1] * len(r)} for r in ids.tolist()]
    start = time.time()
    model.quantize(rows, batch_size=8, calibration_sort=None)
    seconds = time.time() - start

    out = AutoModelForCausalLM.from_pretrained(args.source, dtype=torch.float32)
    layers, maxq, g, same, groups = 0, 2**args.bits - 1, args.group_size, 0, 0
    for name, m in model.model.named_modules():
        if not isinstance(m, PackableQuantLinear):
            continue
        if m.qzero_format() == 1:  # GPTQ v1 in memory, as it saves it: each zero stored minus 1
            convert_gptq_v1_to_v2_format_module(m, bits=m.bits, pack_dtype=m.pack_dtype)
        assert m.bits == args.bits and m.qzero_format() == 2 and not m.planar, name
        n_in, n_out = m.in_features, m.out_features
        assert torch.equal(m.g_idx.long(), torch.arange(n_in) // g), f"{name}: g_idx not static"
        q = unpack_gptq(m.qweight, args.bits, n_in)  # [in, out]
        z = unpack_gptq(m.qzeros.T, args.bits, n_out).T  # [groups, out]
        w = (m.scales.float()[m.g_idx.long()] * (q - z[m.g_idx.long()]).float()).T.contiguous()
        own = PackableQuantLinear.dequantize_weight(m).float().T  # GPTQModel's own unpacking
        assert torch.allclose(w, own, rtol=2e-3, atol=1e-6), f"{name}: unpacking disagrees"
        values = w.reshape(n_out, n_in // g, g).sort(-1).values
        distinct = 1 + (values.diff(dim=-1) != 0).sum(-1)
        assert distinct.max() <= 2**args.bits, f"{name}: {distinct.max()} values in a group"
        target = out.get_submodule(name)
        assert target.weight.shape == w.shape, name
        if qcfg.static_groups and not qcfg.mse:  # static min-max groups of the source weights
            wg = target.weight.detach().reshape(n_out, n_in // g, g)
            lo, hi = wg.amin(-1).clamp(max=0), wg.amax(-1).clamp(min=0)
            same += int((z.T == torch.round(-lo / ((hi - lo) / maxq))).sum())
            groups += z.numel()
        target.weight.data.copy_(w)
        if m.bias is not None:
            target.bias.data.copy_(m.bias.float())
        layers += 1
    assert layers, "GPTQModel quantized no layer"
    assert same >= 0.999 * groups, f"zero points: {same} of {groups} as the source's min-max"
    out.save_pretrained(args.out)
    AutoTokenizer.from_pretrained(args.source).save_pretrained(args.out)
    meta = {"gptq_s": seconds, "layers": layers, "zeros": [same, groups], "config": repr(qcfg)}
    print(f"GPTQModel: {layers} layers; zero points as the source's min-max: {same} of {groups}")
    (args.out / "peer.json").write_text(json.dumps(meta))


def unpack_gptq(words, bits: int, rows: int):
    """GPTQ's packing along dim 0: each column a little-endian stream of ``bits``-bit codes over
    its int32 words (3-bit codes straddle words); the first ``rows`` codes, as int64."""
    import torch

    w = words.to(torch.int64) & 0xFFFFFFFF
    stream = (w.unsqueeze(1) >> torch.arange(32).view(1, 32, 1)) & 1  # [words, 32, cols]
    stream = stream.reshape(-1, w.shape[1])[: rows * bits].reshape(rows, bits, -1)
    return (stream << torch.arange(bits).view(1, bits, 1)).sum(1)


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
    ap.add_argument("--peer", default="llmcompressor", choices=("llmcompressor", "gptqmodel"),
                    help="the peer GPTQ")  # fmt: skip
    ap.add_argument("--peer-python", help="the python of a venv with the peer installed")
    ap.add_argument("--out", default=None, help="the peer's folder (default: a temp)")
    ap.add_argument("--rtn-ppl", type=float, default=None, help="RTN's ppl, for the log-gap")
    ap.add_argument("--peer-observer", dest="observer", default="minmax",
                    choices=("minmax", "mse", "imatrix_mse"), help="the peer's weight observer")  # fmt: skip
    ap.add_argument("--small", action="store_true", help="4 calibration samples, 1 window")
    ap.add_argument("--reuse", action="store_true",
                    help="--out holds a finished peer run of these tokens: score it, skip the peer")  # fmt: skip
    ap.add_argument("--peer-side", action="store_true", help=argparse.SUPPRESS)  # in its venv
    for name, kind in (("source", str), ("calib", str), ("bits", int), ("group-size", int)):
        ap.add_argument(f"--{name}", type=kind, help=argparse.SUPPRESS)
    ap.add_argument("--damp", type=float, default=0.01, help=argparse.SUPPRESS)
    ap.add_argument("--block-size", type=int, default=128, help=argparse.SUPPRESS)
    ap.add_argument("--act-order", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.peer_side:
        return (peer_gptqmodel if args.peer == "gptqmodel" else peer_quantize)(args)

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
    calib_file = out.parent / f"{out.name}-calib.pt"
    reuse = args.reuse and (out / "peer.json").exists()
    if reuse and not torch.equal(torch.load(calib_file), ids):
        raise SystemExit(f"--reuse: {out} was calibrated on other tokens than {ours}'s")
    torch.save(ids, calib_file)
    argv = [args.peer_python, __file__, "--peer-side", "--peer", args.peer]
    argv += ["--source", str(src_dir), "--out", str(out)]
    argv += ["--calib", str(calib_file), "--bits", str(report["bits"])]
    argv += ["--group-size", str(report["group_size"]), "--damp", str(g["damp"])]
    argv += ["--block-size", str(g["block_size"])] + (["--act-order"] if g["act_order"] else [])
    argv += ["--peer-observer", args.observer]
    if not reuse:
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
        ({"gptqmodel": "GPTQModel"}.get(args.peer, "llm-compressor"), peer, peer_s),
    ]
    print(
        f"\n{report['bits']}-bit, group {report['group_size']}, act_order {g['act_order']}, "
        f"ours scale_search {g.get('scale_search', 'minmax')}, peer {args.peer} observer "
        f"{args.observer}, "
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
