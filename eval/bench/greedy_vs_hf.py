"""The decoder's greedy text against transformers' on the same folder, prompt by prompt.

    python eval/bench/greedy_vs_hf.py [FOLDER] [--new 32] [--json OUT]

``FOLDER`` (an HF folder of a supported family; default Gemma 3 270M, ``model=gemma3-270m``) is
loaded by ``compress.decoder`` (float32, eager, fp16 KV cache) and by transformers
(``AutoModelForCausalLM.from_pretrained``, float32, eager attention). Each of
``fast_vs_faithful.PROMPTS``, in the folder's chat template when it has one, is continued greedily
for ``--new`` tokens (EOS ignored) by both; the table gives whether the token ids are equal and,
where they part, the position and transformers' top-2 logit margin there (a near tie that fp32
summation order can tip).
"""

import argparse
import json
from pathlib import Path

import torch
from fast_vs_faithful import PROMPTS

from compress.decoder.generate import generate
from compress.decoder.model import load


def hf_greedy(model, ids: list[int], new: int) -> tuple[list[int], torch.Tensor]:
    """transformers' greedy continuation and its logits at each generated position."""
    out = model.generate(
        torch.tensor([ids]), max_new_tokens=new, do_sample=False, min_new_tokens=new,
        output_logits=True, return_dict_in_generate=True, pad_token_id=0,
    )  # fmt: skip
    return out.sequences[0, len(ids) :].tolist(), torch.stack(out.logits, 1)[0]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("folder", nargs="?", type=Path, default=None)
    p.add_argument("--new", type=int, default=32)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    if args.folder is None:
        from compress.io.source import convert_embedded

        args.folder = Path(convert_embedded("gemma3-270m"))
    from transformers import AutoModelForCausalLM

    ours, tok = load(args.folder)
    hf = AutoModelForCausalLM.from_pretrained(
        args.folder, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    rows = []
    for text in PROMPTS:
        if tok.chat_template:
            ids = tok.apply_chat_template(
                [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True
            )
            ids = ids["input_ids"] if isinstance(ids, dict) else list(ids)
        else:
            ids = tok(text)["input_ids"]
        mine = generate(ours, [ids], args.new, ignore_eos=True).tokens[0]
        with torch.no_grad():
            theirs, logits = hf_greedy(hf, ids, args.new)
        part = next((i for i, (a, b) in enumerate(zip(mine, theirs)) if a != b), None)
        margin = None
        if part is not None:
            top = logits[part].float().topk(2).values
            margin = float(top[0] - top[1])
        rows.append(
            dict(
                prompt=text,
                equal=mine == theirs,
                parts_at=part,
                hf_margin=margin,
                text=tok.decode(mine),
            )
        )
    print(f"{args.folder.name}: greedy, {args.new} new tokens, float32\n")
    print("| prompt | equal | parts at | hf top-2 margin | text (ours) |")
    print("|---|---|---|---|---|")
    for r in rows:
        shown = r["text"].replace("\n", " ").replace("|", "/")[:60]
        at = "-" if r["parts_at"] is None else r["parts_at"]
        margin = "-" if r["hf_margin"] is None else f"{r['hf_margin']:.3f}"
        equal = "yes" if r["equal"] else "no"
        print(f"| {r['prompt']} | {equal} | {at} | {margin} | {shown} |")
    print(f"\n{sum(r['equal'] for r in rows)} of {len(rows)} prompts token-identical")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
