"""One stop/EOS/detokenize path (``compress.decoder.stopping``): plain, speculative and batched
generation stop at the same token with the same text on a stop string, an EOS id and max tokens,
the expectation taken from the tokenizer's own decode of an unstopped greedy run."""

from dataclasses import replace

import pytest
import torch

from compress.decoder.generate import generate
from compress.decoder.speculative.generate import speculative_generate
from compress.decoder.stopping import Detokenizer, Stopping
from compress.serve.engine import Engine
from compress.serve.scheduler import Params
from tests.test_decoder import tiny_tokenizer
from tests.test_speculative import loaded_pair

N = 40


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    target, draft, tok = loaded_pair(tmp_path_factory.mktemp("stop"))
    prompt = tok("the quick brown fox").input_ids
    ref = generate(target, [prompt], N, ignore_eos=True).tokens[0]
    return target, draft, tok, prompt, ref


def three_loops(target, draft, tok, prompt, max_new, stop=(), other=None):
    """``(tokens, streamed text, final text)`` of each loop; the engine batches a second request."""
    out = {}
    for name, fn in (
        ("plain", generate),
        ("speculative", lambda *a, **k: speculative_generate(*a, **k, draft=draft, gamma=4)),
    ):
        pieces = []
        r = fn(target, [prompt], max_new, tok, stop=stop, on_text=lambda _b, t: pieces.append(t))
        out[name] = (r.tokens[0], "".join(pieces), r.texts[0])
    engine = Engine(target, tok, num_blocks=64, block_size=4)
    seq = engine.add(prompt, Params(max_tokens=max_new, stop=stop))
    engine.add(other or prompt[:3], Params(max_tokens=N))
    pieces = []
    while engine.has_work():
        pieces += [e.text for e in engine.step() if e.seq is seq]
    out["engine"] = (seq.output, "".join(pieces), seq.stopping.text)
    return out, seq.finish_reason


def check(out, tokens, text):
    for name, (toks, streamed, final) in out.items():
        assert toks == tokens, name
        assert streamed == final == text, name


def test_max_tokens(models):
    target, draft, tok, prompt, ref = models
    m = next(m for m in range(5, N) if not tok.decode(ref[:m]).endswith("\ufffd"))
    if 1 in ref[:m]:
        pytest.skip("the random model samples <eos> early")
    out, reason = three_loops(target, draft, tok, prompt, m)
    check(out, ref[:m], tok.decode(ref[:m], skip_special_tokens=True))
    assert reason == "length"


def test_stop_string(models):
    target, draft, tok, prompt, ref = models
    full = tok.decode(ref, skip_special_tokens=True)
    a = len(full) // 2
    stop = full[a : a + 3]
    a = full.find(stop)  # its first occurrence
    j = next(j for j in range(1, N + 1) if stop in tok.decode(ref[:j], skip_special_tokens=True))
    if 1 in ref[:j]:
        pytest.skip("the random model samples <eos> early")
    out, reason = three_loops(target, draft, tok, prompt, N, stop=(stop,))
    check(out, ref[:j], full[:a])
    assert reason == "stop" and j < N


def test_eos(models):
    target, draft, tok, prompt, ref = models
    k = next(k for k in range(3, N) if ref[k] not in ref[:k])
    eos = ref[k]
    saved = target.spec
    target.spec = replace(saved, eos_ids=(eos,))  # the runtime reads its stops from the spec
    try:
        out, reason = three_loops(target, draft, tok, prompt, N)
    finally:
        target.spec = saved
    check(out, ref[:k], tok.decode(ref[:k], skip_special_tokens=True))
    assert reason == "stop"


def test_utf8_is_held_until_complete():
    """A character split over byte tokens is emitted once its last byte arrives."""
    tok = tiny_tokenizer()
    ids = tok("é€", add_special_tokens=False).input_ids
    byte_ids = [tok.convert_tokens_to_ids(c) for c in "".join(tok.convert_ids_to_tokens(ids))]
    s = Stopping(len(byte_ids), tokenizer=tok)
    texts = [s.feed(t)[1] for t in byte_ids]  # é: 2 bytes, €: 3 bytes
    assert texts == ["", "é", "", "", "€"]
    assert s.finish_reason == "length" and s.text == "é€"
    s = Stopping(5, eos={7})
    assert s.feed(3) == (True, "") and s.feed(7) == (False, "") and s.finish_reason == "stop"
    assert s.feed(4) == (False, "") and s.tokens == [3]


TEXTS = (
    "naïve café — 東京の天気は晴れ 🌤️ and 😀🎉 emoji; Ünïcödé ß ﬁ Ωμέγα",
    "  leading spaces,   runs of spaces\nnewlines\n\n\ttabs and 'quotes' \"too\"...",
    "don't won't it's — merges: thethe the.the, 1234567 3.14159 x=y+z",
)


def metaspace_tokenizer():
    """A SentencePiece-style BPE (``▁`` for a space, the first word's space dropped on decode)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.BPE(unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Metaspace()
    tk.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>", "<eos>"])
    tk.train_from_iterator(list(TEXTS) * 5, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<eos>", unk_token="<unk>")


class Counting:
    """A tokenizer whose ``decode`` counts the ids it is given."""

    def __init__(self, tok):
        self.tok, self.ids = tok, 0

    def decode(self, ids, **kw):
        self.ids += len(ids)
        return self.tok.decode(ids, **kw)


def streamed(tok, ids) -> tuple[list[str], str]:

    d = Detokenizer(tok)
    pieces = [d.push(i) for i in ids]
    pieces.append(d.flush())
    return pieces, d.text


TOKENIZERS = {
    "byte-level": lambda request: tiny_tokenizer(),
    "smollm2": lambda request: request.getfixturevalue("tokenizer"),
    "metaspace": lambda request: metaspace_tokenizer(),
}


def rows_of(tok) -> list[list[int]]:
    """The TEXTS, random ids (special tokens among them) and all of TEXTS in one row."""
    g = torch.Generator().manual_seed(0)
    rows = [tok(t, add_special_tokens=False).input_ids for t in TEXTS]
    rows.append(torch.randint(0, len(tok), (300,), generator=g).tolist())
    rows.append(rows[0] + rows[1] + rows[2])
    return rows


@pytest.mark.parametrize("which", list(TOKENIZERS))
def test_incremental_text_equals_decode_of_the_whole_row(which, request):
    """Streamed pieces concatenate to ``tokenizer.decode`` of all the ids, for multi-byte text
    (split over byte tokens), leading spaces and merges, and random ids (special tokens among
    them); nothing streamed is ever taken back."""
    tok = TOKENIZERS[which](request)
    for ids in rows_of(tok):
        whole = tok.decode(ids, skip_special_tokens=True)
        pieces, text = streamed(tok, ids)
        assert "".join(pieces) == text == whole, (which, ids)
        for k in range(len(pieces)):
            assert whole.startswith("".join(pieces[: k + 1]))


@pytest.mark.parametrize("which", list(TOKENIZERS))
def test_a_row_cut_anywhere_streams_its_decode(which, request):
    """A row ending at any token, inside a multi-byte character too (byte tokens of an emoji, a
    CJK character), streams exactly ``decode`` of its ids: a character left incomplete comes
    out at the end as the U+FFFD that ``decode`` gives it."""
    tok = TOKENIZERS[which](request)
    ids = tok(TEXTS[0], add_special_tokens=False).input_ids
    cut_inside = 0
    for n in range(1, len(ids) + 1):
        whole = tok.decode(ids[:n], skip_special_tokens=True)
        cut_inside += whole.endswith("\ufffd")
        pieces, text = streamed(tok, ids[:n])
        assert "".join(pieces) == text == whole, (which, n)
    if which != "metaspace":  # its vocabulary holds the whole characters of the text
        assert cut_inside > 0  # the cuts did fall inside characters


@pytest.mark.parametrize("which", list(TOKENIZERS))
def test_stop_strings_over_multi_byte_text(which, request):
    """A stop string (multi-byte, or beginning with a space) ends the row where its first
    occurrence in ``decode(ids)`` begins; the streamed text is what comes before it."""
    tok = TOKENIZERS[which](request)
    ids = tok(" ".join(TEXTS), add_special_tokens=False).input_ids
    whole = tok.decode(ids, skip_special_tokens=True)
    for stop in ("東京", "😀🎉", "ß", " runs of", "the.the", "ïv"):
        assert stop in whole
        d = Detokenizer(tok, (stop,))
        pieces = []
        for i in ids:
            pieces.append(d.push(i))
            if d.stopped:
                break
        pieces.append(d.flush())
        assert d.stopped and "".join(pieces) == d.text == whole[: whole.find(stop)], stop


def test_detokenizing_reads_a_bounded_window_per_token():
    """O(1) amortized: the ids decoded per pushed id stay bounded (today's whole-row decoding
    reads n(n+1)/2 ids for n tokens)."""
    tok = tiny_tokenizer()
    ids = tok(" ".join(TEXTS) * 20, add_special_tokens=False).input_ids
    counting = Counting(tok)
    pieces, text = streamed(counting, ids)
    assert text == tok.decode(ids, skip_special_tokens=True)
    assert len(ids) > 1000 and counting.ids <= 8 * len(ids), counting.ids
