"""Token ids kept per process (``compress.io.data.tokenize``): the same ids as the tokenizer's
own call, served without tokenizing again, and never served to a tokenizer in another state."""

import copy
import random

import pytest

from compress.io import data
from tests.conftest import DATA


class Counting:
    """A tokenizer that counts its calls (the memo keys on the backend's serialized state)."""

    def __init__(self, tok):
        self.tok = tok
        self.backend_tokenizer = tok.backend_tokenizer
        self.calls = 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.tok(*args, **kwargs)


@pytest.fixture
def text():
    words = (DATA / "wikitext-2" / "wiki.test.raw").read_text(encoding="utf-8").split(" ")
    start = random.randrange(len(words) - 3000)
    return " ".join(words[start : start + 3000])  # a fresh slice every run


@pytest.fixture(autouse=True)
def empty_memo(monkeypatch):
    monkeypatch.setattr(data, "_TOKENIZED", type(data._TOKENIZED)())


def test_kept_ids_are_the_tokenizers_and_are_not_tokenized_again(tokenizer, text):
    expected = tokenizer(text, add_special_tokens=True).input_ids
    tok = Counting(tokenizer)
    first = data.tokenize(tok, text)
    first[:10] = -1  # a caller's change does not reach the kept copy
    again = data.tokenize(tok, text)
    assert tok.calls == 1
    assert again.tolist() == expected
    other = text + " and a different ending"
    assert data.tokenize(tok, other).tolist() == tokenizer(other).input_ids
    assert tok.calls == 2


def test_a_tokenizer_in_another_state_is_not_served_the_kept_ids(tokenizer, text):
    data.tokenize(Counting(tokenizer), text)
    changed = copy.deepcopy(tokenizer)
    word = text.split()[len(text.split()) // 2]
    changed.add_tokens([f"{word}"])  # the word now one token: different ids for the same text
    counted = Counting(changed)
    ids = data.tokenize(counted, text)
    assert counted.calls == 1
    assert ids.tolist() == changed(text).input_ids != tokenizer(text).input_ids


def test_only_the_last_few_texts_are_kept(tokenizer, text):
    tok = Counting(tokenizer)
    for i in range(data._TOKENIZED_KEEP + 1):
        data.tokenize(tok, f"{i} {text[:200]}")
    assert len(data._TOKENIZED) == data._TOKENIZED_KEEP
    data.tokenize(tok, f"0 {text[:200]}")  # the oldest was dropped
    assert tok.calls == data._TOKENIZED_KEEP + 2
