"""Incremental detokenizing against decoding the whole row at every token, side by side.

    python eval/bench/bench_detok.py [--tokens 4096] [--rounds 3]

Both stream the same ids of WikiText-2 validation text (``COMPRESS_DATA_DIR``) through the
default model's tokenizer and must give the same text; the table gives each one's time for the
whole row, tokens/s and the ratio. ``whole-row`` is the detokenizer before the incremental one:
``decode(ids[:n])`` at every token n, O(n) per token.
"""

import argparse
import os
import time

from transformers import AutoTokenizer

from compress.decoder.stopping import Detokenizer
from compress.io.data import read_text
from compress.io.source import convert_default_model


def whole_row(tok, ids) -> str:
    """The former ``Detokenizer.push``: the whole row decoded at every token."""
    text, emitted = "", 0
    for n in range(1, len(ids) + 1):
        text = tok.decode(ids[:n], skip_special_tokens=True)
        if not text.endswith("\ufffd"):
            emitted = len(text)
    return text[:emitted]


def incremental(tok, ids) -> str:
    d = Detokenizer(tok)
    for i in ids:
        d.push(i)
    d.flush()
    return d.text


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args(argv)
    tok = AutoTokenizer.from_pretrained(convert_default_model())
    ids = tok(
        read_text(
            os.path.join(
                os.environ.get("COMPRESS_DATA_DIR", "../shared/data"),
                "wikitext-2",
                "wiki.valid.tokens",
            )
        ),
        add_special_tokens=False,
    ).input_ids
    ids = ids[: args.tokens]
    rows, texts = [], {}
    for name, fn in (("whole-row", whole_row), ("incremental", incremental)):
        times = []
        for _ in range(args.rounds):
            start = time.perf_counter()
            texts[name] = fn(tok, ids)
            times.append(time.perf_counter() - start)
        rows.append((name, sorted(times)[len(times) // 2]))
    same = texts["whole-row"] == texts["incremental"] == tok.decode(ids, skip_special_tokens=True)
    print(f"{len(ids)} tokens, median of {args.rounds}; same text: {same}")
    print("| detokenizer | seconds | tokens/s | speed-up |\n|---|---|---|---|")
    base = rows[0][1]
    for name, t in rows:
        print(f"| {name} | {t:.3f} | {len(ids) / t:,.0f} | {base / t:.1f}x |")


if __name__ == "__main__":
    main()
