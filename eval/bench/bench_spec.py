"""Speculative decoding, batch 1, greedy: every drafting system against the target alone, one run.

    python eval/bench/bench_spec.py [--target SOURCE] --drafts outputs/awq_int4 [...]
        [--qdtype bfloat16 --lean] [--compile] [--draft-head int8] [--gamma 5]
        [--draft-gammas 3 4 5] [--skip-counts 3 6 8] [--all-arms]
        [--search] [--new 128] [--threads 1] [--json OUT] [--quick]

Prompts: 16 WikiText-2 validation article openings (title and first paragraph, at most
``--prompt-len`` tokens) and 16 chat prompts through the tokenizer's chat template
(``--quick``: one of each, 8 new tokens). EOS is ignored. Systems, run one after another on each
prompt (one untimed warm-up round first):

    target              compress.decoder's plain greedy decoding (fp16 KV cache)
    spec:NAME           the target verifying draft NAME's γ tokens per round (``--gamma``;
                        ``--qdtype bfloat16 --lean``: the draft's int4 layers in ATen's int4pack;
                        ``+compile`` with ``--compile``: the draft's steps compiled;
                        ``+headint8``: its output head quantized at load; ``:gG`` per
                        ``--draft-gammas``)
    hf-assisted:NAME    transformers ``generate(assistant_model=...)`` on the same pair (its own
                        loader, eager; candidate length: its "heuristic" schedule from 5)
    self:skipN          self-speculative, the N middle layers of unified layer skipping, γ fixed
    self:skipN:gG       every arm of the bandits as a fixed configuration (``--all-arms``)
    self:searched       the skip set searched on calibration text (``--search``; saved beside
                        the target folder)
    bandit / ucb1       per prompt, the unimodal (SP2EC-style) or UCB1 bandit over skip sets x γ

Columns: decode tok/s (tokens after the first / their time) median over prompts and its
interquartile range (the noise), speed-up = median over prompts of tok/s / the target's tok/s
on the same prompt, acceptance α and tokens per target pass (totals over the prompts), and
greedy exactness: prompts whose tokens equal the target's, and of the others how many first
diverge at a numerical tie (the target's top-2 logit gap < 1e-4 there). With ``--all-arms``
a last line compares the bandits' mean tok/s with the best fixed arm in hindsight and the
median fixed arm.
"""

import argparse
import json
import os
import re
import statistics
import sys
import time
from pathlib import Path

import torch

from compress.eval.ties import first_divergence_is_tie

CHAT = [
    "What is the capital of France?",
    "Write a haiku about autumn leaves.",
    "Explain photosynthesis to a ten-year-old.",
    "Give me three tips for a job interview.",
    "How do vaccines work?",
    "Summarise the plot of Romeo and Juliet in two sentences.",
    "What is the difference between weather and climate?",
    "Suggest a name for a small bakery.",
    "How many legs does a spider have, and why?",
    "Write a short thank-you note to a teacher.",
    "Why is the sky blue?",
    "List four healthy breakfast ideas.",
    "What does a compiler do?",
    "Describe a sunset at the beach.",
    "How can I improve my sleep?",
    "Tell me a fun fact about octopuses.",
]


def wiki_openings(tokenizer, n: int, max_tokens: int) -> list[list[int]]:
    """The first ``n`` WikiText-2 validation articles' title and first paragraph, as token ids."""
    from compress.io.data import wikitext_file

    text = wikitext_file("wiki.valid.tokens").read_text(encoding="utf-8")
    out = []
    for m in re.finditer(r"^ = ([^=\n]+) = \n \n([^\n]+)\n", text, flags=re.M):
        text = f"{m.group(1).strip()}\n\n{m.group(2).strip()}"
        out.append(tokenizer(text).input_ids[:max_tokens])
        if len(out) == n:
            break
    return out


def chat_prompts(tokenizer, n: int) -> list[list[int]]:
    out = []
    for q in CHAT[:n]:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True
        )
        out.append(tokenizer(text, add_special_tokens=False).input_ids)
    return out


class HFAssisted:
    """transformers' assisted generation with ``draft`` as assistant, timed with a streamer."""

    def __init__(self, target_folder, draft_folder):
        from compress.io.checkpoint import load_run

        self.model, _ = load_run(target_folder)
        self.draft, _ = load_run(draft_folder)
        cfg = self.draft.generation_config
        cfg.num_assistant_tokens, cfg.num_assistant_tokens_schedule = 5, "heuristic"
        cfg.assistant_confidence_threshold = 0.0

    def __call__(self, ids, new):
        times = []

        class Clock:  # the streamer protocol: put(prompt), put(tokens) per step, end()
            def put(self, value):
                times.append((time.perf_counter(), value.numel()))

            def end(self):
                pass

        with torch.no_grad():
            out = self.model.generate(
                torch.tensor([ids]),
                max_new_tokens=new,
                min_new_tokens=new,
                do_sample=False,
                assistant_model=self.draft,
                pad_token_id=0,
                streamer=Clock(),
            )
        tokens = out[0, len(ids) :].tolist()
        (first, n_first), last = times[1], times[-1][0]  # the first generated token(s), the end
        rate = (len(tokens) - n_first) / (last - first) if last > first else float("nan")
        return dict(
            tokens=tokens, tok_s=rate, drafted=0, accepted=0, rounds=0, steps=len(tokens) - 1
        )


def result_row(r) -> dict:
    return dict(
        tokens=r.tokens[0],
        tok_s=r.decode_tok_s,
        drafted=getattr(r, "drafted", 0),
        accepted=getattr(r, "accepted", 0),
        rounds=getattr(r, "rounds", r.decode_steps),
        steps=r.decode_steps,
    )


def systems(args, target, tok):
    """``{name: run(ids, new) -> row}`` in the order of the module docstring."""
    from compress.decoder.generate import generate
    from compress.decoder.speculative.bandit import default_skip_counts, self_bandit
    from compress.decoder.speculative.drafts import LayerSkipDraft, ModelDraft, load_draft
    from compress.decoder.speculative.generate import speculative_generate
    from compress.decoder.speculative.layer_skip import (
        calibration_ids,
        layer_costs,
        searched_skip,
        unified_skip,
    )

    def spec(draft, gamma=args.gamma):
        return lambda ids, new: result_row(
            speculative_generate(target, [ids], new, ignore_eos=True, draft=draft, gamma=gamma)
        )

    out = {"target": lambda ids, new: result_row(generate(target, [ids], new, ignore_eos=True))}
    for folder in args.drafts:
        draft = load_draft(
            folder,
            target,
            tok,
            lean=args.lean,
            qdtype=getattr(torch, args.qdtype) if args.qdtype else None,
            head=args.draft_head,
        )
        name = Path(folder).name + (f"+head{args.draft_head}" if args.draft_head != "none" else "")
        for g in args.draft_gammas or [args.gamma]:
            tag = f"spec:{name}" + ("+compile" if args.compile else "")
            tag += f":g{g}" if args.draft_gammas else ""
            out[tag] = spec(ModelDraft(draft, compile=args.compile), g)
    if not args.no_hf:
        for folder in args.drafts:
            out[f"hf-assisted:{Path(folder).name}"] = HFAssisted(args.target, folder)
    L = target.config.num_hidden_layers
    counts = args.skip_counts or default_skip_counts(L)
    gammas = (1, 2, 3, 4, 6)
    for n in counts:
        draft = LayerSkipDraft(target, unified_skip(L, n))
        for g in gammas if args.all_arms else [args.gamma]:
            out[f"self:skip{n}" + (f":g{g}" if args.all_arms else "")] = spec(draft, g)
    if args.search:
        skip = searched_skip(
            args.target,
            target,
            calibration_ids(tok),
            args.gamma,
            log=lambda m: print(m, file=sys.stderr),
        )
        if skip:
            out["self:searched"] = spec(LayerSkipDraft(target, skip))
        else:
            print(
                "the skip-set search found no set faster than the target (modelled): "
                "no self:searched row",
                file=sys.stderr,
            )
    costs = layer_costs(target)
    for kind in ("bandit", "ucb1"):  # a fresh bandit per prompt: it adapts within one generation
        out[kind] = (
            lambda kind: (
                lambda ids, new: result_row(
                    speculative_generate(
                        target,
                        [ids],
                        new,
                        ignore_eos=True,
                        draft=self_bandit(target, kind, counts, gammas, costs),
                    )
                )
            )
        )(kind)
    return out


def summarise(name, rows, base) -> dict:
    rates = [r["tok_s"] for r in rows]
    q = statistics.quantiles(rates, n=4) if len(rates) > 1 else [rates[0]] * 3
    drafted, accepted = sum(r["drafted"] for r in rows), sum(r["accepted"] for r in rows)
    rounds, steps = sum(r["rounds"] for r in rows), sum(r["steps"] for r in rows)
    return dict(
        system=name,
        tok_s=statistics.median(rates),
        iqr=q[2] - q[0],
        mean_tok_s=statistics.fmean(rates),
        speedup=statistics.median(r["tok_s"] / b["tok_s"] for r, b in zip(rows, base)),
        alpha=accepted / drafted if drafted else float("nan"),
        tokens_per_pass=steps / rounds if rounds else float("nan"),
        identical=sum(r["tokens"] == b["tokens"] for r, b in zip(rows, base)),
        ties=sum(r.get("tie", False) for r in rows),
        prompts=len(rows),
    )


def bandit_summary(table: list[dict]) -> dict:
    """The bandits' mean tok/s against the best fixed arm in hindsight and the median fixed arm
    (the fixed arms are the ``self:skipN:gG`` rows of ``--all-arms``)."""
    arm = re.compile(r"self:skip\d+:g\d+")
    fixed = sorted(t["mean_tok_s"] for t in table if arm.fullmatch(t["system"]))
    if not fixed:
        return {}
    out = dict(best_fixed=fixed[-1], median_fixed=statistics.median(fixed))
    for t in table:
        if t["system"] in ("bandit", "ucb1"):
            out[t["system"]] = t["mean_tok_s"]
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", help="target folder (default: the default model's converted folder)")
    p.add_argument("--drafts", nargs="*", default=[], help="draft model folders (same tokenizer)")
    p.add_argument("--gamma", type=int, default=5)
    p.add_argument(
        "--skip-counts", type=int, nargs="*", help="unified skip sets to run (layers skipped)"
    )
    p.add_argument("--all-arms", action="store_true", help="every bandit arm as a fixed system")
    p.add_argument("--search", action="store_true", help="also the searched skip set")
    p.add_argument(
        "--no-hf", action="store_true", help="leave out transformers' assisted generation"
    )
    p.add_argument("--new", type=int, default=128)
    p.add_argument("--prompts", type=int, default=16, help="of each kind (WikiText-2, chat)")
    p.add_argument("--prompt-len", type=int, default=64, help="most tokens of a WikiText-2 prompt")
    p.add_argument(
        "--qdtype",
        choices=("bfloat16",),
        help="the drafts' quantized layers compute in bfloat16 (ATen's int4pack kernel on the CPU)",
    )
    p.add_argument(
        "--lean",
        action="store_true",
        help="drafts keep only the int4pack form (with --qdtype bfloat16)",
    )
    p.add_argument("--compile", action="store_true", help="each draft's decode step compiled (CPU)")
    p.add_argument(
        "--draft-head",
        choices=("none", "int8", "int4"),
        default="none",
        help="the drafts' output head quantized at load (compress.layers.head)",
    )
    p.add_argument(
        "--draft-gammas", type=int, nargs="*", help="one row per γ for each draft (default --gamma)"
    )
    p.add_argument("--threads", type=int)
    p.add_argument(
        "--quick", action="store_true", help="1 prompt of each kind, 8 new tokens: a smoke run"
    )
    p.add_argument("--json", help="write the table and per-prompt rows here")
    args = p.parse_args(argv)
    if args.quick:
        args.prompts, args.new = 1, 8
    if args.threads:
        torch.set_num_threads(args.threads)
    from compress.decoder.model import load
    from compress.errors import CompressError
    from compress.io.source import convert_default_model

    try:
        args.target = args.target or str(convert_default_model())
        target, tok = load(args.target)
        if tok is None:
            raise CompressError(
                f"'{args.target}' has no tokenizer: the benchmark's prompts are text."
            )
        prompts = wiki_openings(tok, args.prompts, args.prompt_len)
        prompts += chat_prompts(tok, args.prompts)
        runs = systems(args, target, tok)
    except CompressError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    for name, run in runs.items():  # warm-up: kernels prepare, allocations settle
        run(prompts[0][:8], 3)
    rows = {name: [] for name in runs}
    for i, ids in enumerate(prompts):
        for name, run in runs.items():
            rows[name].append(run(ids, args.new))
        base = rows["target"][-1]
        for name in runs:
            r = rows[name][-1]
            if r["tokens"] != base["tokens"]:
                r["tie"] = first_divergence_is_tie(target, ids, base["tokens"], r["tokens"])
        rates = "  ".join(f"{n} {rows[n][-1]['tok_s']:.1f}" for n in runs)
        print(f"prompt {i + 1}/{len(prompts)}: {rates}", file=sys.stderr)
    table = [summarise(name, rows[name], rows["target"]) for name in runs]
    print(f"{len(prompts)} prompts, {args.new} new tokens, greedy, batch 1; tok/s median [IQR]")
    print(
        f"{'system':28s} {'tok/s':>8s} {'IQR':>7s} {'speed-up':>8s} {'alpha':>6s} "
        f"{'tok/pass':>8s} {'identical':>9s} {'ties':>5s}"
    )
    for t in table:
        print(
            f"{t['system']:28s} {t['tok_s']:8.1f} {t['iqr']:7.1f} {t['speedup']:8.2f} "
            f"{t['alpha']:6.3f} {t['tokens_per_pass']:8.2f} "
            f"{t['identical']:5d}/{t['prompts']:<3d} {t['ties']:5d}"
        )
    summary = bandit_summary(table)
    if summary:
        print(
            f"mean tok/s over the prompts: best fixed arm {summary['best_fixed']:.1f}, median fixed "
            f"arm {summary['median_fixed']:.1f}; "
            + ", ".join(
                f"{k} {summary[k]:.1f} ({summary[k] / summary['best_fixed']:.1%} of the best)"
                for k in ("bandit", "ucb1")
            )
        )
    if args.json:
        out = Path(args.json)
        tmp = out.with_name(out.name + f".tmp{os.getpid()}")
        tmp.write_text(
            json.dumps(
                {"args": vars(args), "table": table, "bandit_summary": summary, "rows": rows},
                indent=1,
            )
        )
        tmp.replace(out)


if __name__ == "__main__":
    main()
