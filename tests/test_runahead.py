"""KV-Runahead prefill over 2 gloo processes against a single-process prefill."""

import pytest
import torch

from compress.decoder.generate import generate
from compress.decoder.kv import new_cache
from compress.decoder.model import load
from compress.errors import CompressError
from compress.serve.engine import Engine
from compress.serve.runahead import RunaheadPrefill, balanced_bounds
from compress.serve.scheduler import Params
from tests.test_decoder import rel_err, save, tiny_hf, tiny_tokenizer


def test_balanced_bounds_equalize_the_cost_model():
    lin, att = 1000.0, 40.0

    def cost(s, e):  # summed per token, independently of the closed form
        return sum(lin + att * (t + 1) for t in range(s, e))

    for T, n in [(8000, 2), (2048, 4), (100, 3), (5, 5)]:
        b = balanced_bounds(T, n, lin, att)
        assert b[0] == 0 and b[-1] == T and all(x < y for x, y in zip(b, b[1:]))
        costs = [cost(s, e) for s, e in zip(b, b[1:])]
        if T > 5:
            assert [y - x for x, y in zip(b, b[1:])] == sorted(
                (y - x for x, y in zip(b, b[1:])), reverse=True
            )
            one = lin + att * T  # the most one token can cost
            assert max(costs) - min(costs) <= 2 * one
    assert balanced_bounds(100, 4) == [0, 25, 50, 75, 100]  # no attention term: even chunks
    with pytest.raises(CompressError, match="prefill ranks"):
        balanced_bounds(3, 4)


@pytest.mark.slow
def test_two_ranks_give_the_single_process_prefill(tmp_path):
    """K/V of every layer and the last logits within 1e-5 of one process's prefill, balanced and
    even; the engine prefilling long prompts this way decodes what ``generate`` decodes alone."""
    folder = save(tiny_hf(), tmp_path, tiny_tokenizer())
    model, _ = load(folder)
    ids = torch.randint(2, 300, (90,), generator=torch.Generator().manual_seed(0)).tolist()
    ref_cache = new_cache(model, "full", 1, len(ids))
    with torch.no_grad():
        ref = model(torch.tensor([ids]), ref_cache, last=True)[0, -1]
    pool = RunaheadPrefill(model, folder, 2)
    try:
        for balance in ("cost", "even"):
            pool.balance = balance
            b = pool.bounds(len(ids))
            assert (b[1] > 45) == (balance == "cost")  # balanced: the first chunk longer
            logits, cache = pool.prefill(ids)
            assert rel_err(logits, ref) < 1e-5
            assert cache.length == len(ids)
            for layer in range(model.config.num_hidden_layers):
                assert rel_err(cache.k[layer], ref_cache.k[layer]) < 1e-5
                assert rel_err(cache.v[layer], ref_cache.v[layer]) < 1e-5
        prompts = [ids, ids[5:70], ids[:20]]  # a long prompt at the queue's head goes to the ranks
        engine = Engine(model, num_blocks=64, block_size=4, runahead=pool, runahead_min_tokens=30)
        seqs = engine.generate(prompts, Params(max_tokens=8, ignore_eos=True))
        assert [s.output for s in seqs] == [
            generate(model, [p], 8, ignore_eos=True).tokens[0] for p in prompts
        ]
        assert engine.stats()["free_blocks"] == 64 and engine.stats()["runahead_prefills"] == 2
    finally:
        pool.close()
