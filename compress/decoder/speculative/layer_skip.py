"""Which layers a self-speculative draft skips: the unified balanced choice, or a searched set.

Unified layer skipping (arXiv 2404.06954) fixes the skipped layers from the target speed-up
alone, input-independent: the first and last layers always run and the N skipped ones are
spread evenly over layers 1..L−2, centred on the middle::

    skip_i = 1 + floor((i + 1/2) (L − 2) / N)        i = 0..N−1

(a draft r times faster than the target skips N ≈ L (1 − 1/r) layers).

The searched set (:func:`search_skip`) grows greedily on calibration text: each step adds the
layer whose skipping most raises the modelled accepted tokens per second

    tokens/s = (1 − α^(γ+1)) / (1 − α) / (γ c_draft + c_target),   c_draft = c_0 + (L − N) c_layer

with α the greedy agreement of draft and target over the text (the draft reading the target's
K/V, as it does when drafting) and the costs measured once per model. It is saved as JSON
beside the run folder (``RUN.skip.json``), so the search runs once per model and γ.
``python -m compress.decoder.speculative.layer_skip RUN`` prints α and the modelled rate per skip count.
"""

import json
import os
import time
from pathlib import Path

import torch

from compress.decoder.kv import new_cache
from compress.decoder.model import load
from compress.errors import CompressError
from compress.io.data import wikitext_file

CALIBRATION_TOKENS = 96  # of WikiText-2 validation text for the skip-set search


def unified_skip(n_layers: int, n_skip: int) -> list[int]:
    """The ``n_skip`` layers unified layer skipping leaves out of an ``n_layers`` model."""
    if not 0 < n_skip <= n_layers - 2:
        raise CompressError(
            f"--skip {n_skip}: a {n_layers}-layer model can skip 1 to "
            f"{n_layers - 2} layers (the first and last always run)."
        )
    return [1 + int((i + 0.5) * (n_layers - 2) / n_skip) for i in range(n_skip)]


def parse_layers(text: str, n_layers: int) -> list[int]:
    """``"3,5,7"`` -> ``[3, 5, 7]``, checked against the model's layer count."""
    try:
        layers = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        raise CompressError(
            f"--skip-layers '{text}': give layer indices separated by commas, e.g. 4,6,8."
        )
    if not layers or layers[0] < 0 or layers[-1] >= n_layers or len(layers) >= n_layers:
        raise CompressError(
            f"--skip-layers '{text}': indices must lie in 0..{n_layers - 1} and "
            f"leave at least one layer running."
        )
    return layers


def skip_file(run: Path) -> Path:
    """Where the searched skip sets of ``run`` are saved: beside the folder, not in its manifest."""
    run = Path(run).resolve()
    return run.parent / f"{run.name}.skip.json"


@torch.no_grad()
def agreement(model, ids: list[int], skip) -> float:
    """Greedy acceptance α: how often the draft (``model`` without ``skip``), reading the target's
    K/V of the text before each position, predicts the target's argmax next token."""

    device, skip = model.device, frozenset(skip)
    cache = new_cache(model, "full", 1, len(ids))
    target = model(torch.tensor([ids], device=device), cache)[0].argmax(-1)  # the target's K/V
    hits = 0
    for t in range(len(ids) - 1):  # one token at a time, as the draft runs
        kept = [(k[:, :, t].clone(), v[:, :, t].clone()) for k, v in zip(cache.k, cache.v)]
        cache.mark(t)  # the full cache holds the target's K/V of every slot
        pos = torch.tensor([t], device=device)
        guess = model(torch.tensor([[ids[t]]], device=device), cache, pos=pos, skip=skip)[0, -1]
        hits += int(guess.argmax() == target[t])
        for (k, v), (k0, v0) in zip(zip(cache.k, cache.v), kept):  # the target's K/V back at slot t
            k[:, :, t], v[:, :, t] = k0, v0
    return hits / max(len(ids) - 1, 1)


def layer_costs(model, reps: int = 5) -> tuple[float, float]:
    """``(c_0, c_layer)`` seconds of one decode step: the part outside the layers and one layer."""

    L, device = model.spec.n_layers, model.device
    cache = new_cache(model, "fp16", 1, 64)
    x = torch.tensor([[1]], device=device)

    def step(skip):
        best = float("inf")
        for _ in range(reps):
            cache.rollback(0)
            t = time.perf_counter()
            model(x, cache, pos=torch.tensor([0], device=device), skip=skip)
            best = min(best, time.perf_counter() - t)
        return best

    full, none = step(frozenset()), step(frozenset(range(L)))
    return none, max(full - none, 1e-9) / L


def expected_rate(
    alpha: float, gamma: int, kept: int, costs: tuple[float, float], n_layers: int
) -> float:
    """Modelled tokens per second (the module docstring's formula)."""
    c0, cl = costs
    tokens = gamma + 1 if alpha >= 1 else (1 - alpha ** (gamma + 1)) / (1 - alpha)
    return tokens / (gamma * (c0 + kept * cl) + c0 + n_layers * cl)


def search_skip(
    model, ids: list[int], gamma: int = 4, max_skip: int | None = None, log=None
) -> dict:
    """Greedy search of the skip set maximising :func:`expected_rate` on the calibration ``ids``."""
    L = model.spec.n_layers
    costs = layer_costs(model)
    skip, best = [], expected_rate(1.0, 0, L, costs, L)  # no draft: one token per target pass
    for _ in range(min(max_skip or L - 2, L - 2)):
        trials = []
        for i in range(1, L - 1):
            if i not in skip:
                a = agreement(model, ids, skip + [i])
                trials.append((expected_rate(a, gamma, L - len(skip) - 1, costs, L), i, a))
        rate, i, a = max(trials)
        if rate <= best:
            break
        skip, best = sorted(skip + [i]), rate
        if log:
            log(f"skip {skip}: alpha {a:.3f}, modelled {rate:.1f} tok/s")
    return {"skip": skip, "gamma": gamma, "modelled_tok_s": best, "calibration_tokens": len(ids)}


def searched_skip(run, model, ids: list[int], gamma: int = 4, log=None) -> list[int]:
    """The saved searched skip set of ``run`` for ``gamma``; searched (and saved) the first time."""
    path = skip_file(run)
    saved = json.loads(path.read_text()) if path.is_file() else {}
    key = f"gamma={gamma}"
    if key not in saved:
        saved[key] = search_skip(model, ids, gamma, log=log)
        tmp = path.with_name(path.name + f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(saved, indent=1))
        tmp.replace(path)
    return saved[key]["skip"]


def calibration_ids(tokenizer) -> list[int]:
    """The last ``CALIBRATION_TOKENS`` tokens of WikiText-2 validation, the project's calibration
    split (the speculative benchmark's prompts are its openings, far from here)."""

    path = wikitext_file("wiki.valid.tokens")
    if not path.is_file():
        raise CompressError(
            f"the skip-set search reads calibration text from {path}, which does not exist."
        )
    text = path.read_text(encoding="utf-8")[-4000:]
    return tokenizer(text[text.index(" ") :]).input_ids[-CALIBRATION_TOKENS:]


def main(argv=None) -> None:
    """``python -m compress.decoder.speculative.layer_skip RUN [--counts 2 4 6] [--gamma 4]``: per unified skip
    count, the greedy agreement α on the calibration text and the modelled tokens per second."""
    import argparse
    import sys

    p = argparse.ArgumentParser(
        prog="python -m compress.decoder.speculative.layer_skip",
        description=main.__doc__.splitlines()[0],
    )
    p.add_argument("run")
    p.add_argument("--counts", type=int, nargs="*")
    p.add_argument("--gamma", type=int, default=4)
    args = p.parse_args(argv)
    try:
        model, tok = load(args.run)
        if tok is None:
            raise CompressError(f"'{args.run}' has no tokenizer to read the calibration text with.")
        ids, L = calibration_ids(tok), model.spec.n_layers
        costs = layer_costs(model)
        for n in args.counts or range(1, L - 1):
            skip = unified_skip(L, n)
            a = agreement(model, ids, skip)
            rate = expected_rate(a, args.gamma, L - n, costs, L)
            print(f"skip {n:3d} {skip}: alpha {a:.3f}, modelled {rate:.1f} tok/s", flush=True)
    except CompressError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
