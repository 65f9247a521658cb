"""A run folder loaded by stock transformers (no trust_remote_code) beside our decoder: prints the
relative difference of their float32 logits on a prompt, and whether every position's argmax
agrees. For the stock folders compress writes (``recipe=mla mla=deepseek_v3``, the MoE RTN and
AWQ folders)::

    python eval/bench/stock_load_check.py RUN [RUN ...] [--prompt TEXT]
"""

import argparse
import json
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from compress.decoder.kv import new_cache
from compress.decoder.model import load

PROMPT = "The capital of France is Paris. The capital of Germany is"


@torch.no_grad()
def check(folder: Path, prompt: str) -> dict:
    raw = json.loads((folder / "config.json").read_text())
    ids = AutoTokenizer.from_pretrained(folder)(prompt, return_tensors="pt").input_ids
    hf = AutoModelForCausalLM.from_pretrained(folder).eval()
    for p in hf.parameters():  # compute in float32, whatever dtype the folder loads in
        if p.is_floating_point():
            p.data = p.data.float()
    want = hf(ids).logits[0].float()
    ours, _ = load(folder)
    got = ours(ids, new_cache(ours, "full", 1, ids.shape[1]))[0]
    return {
        "model_type": raw["model_type"],
        "auto_map": "auto_map" in raw,
        "rel": ((got - want).norm() / want.norm()).item(),
        "argmax_equal": bool(torch.equal(got.argmax(-1), want.argmax(-1))),
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("folders", nargs="+", type=Path)
    ap.add_argument("--prompt", default=PROMPT)
    args = ap.parse_args()
    print("| folder | model_type | auto_map | rel. logit difference | argmax equal |")
    print("|---|---|---|---|---|")
    for folder in args.folders:
        r = check(folder, args.prompt)
        print(
            f"| {folder.name} | {r['model_type']} | {r['auto_map']} | {r['rel']:.2e} | "
            f"{r['argmax_equal']} |"
        )


if __name__ == "__main__":
    main()
