"""Continuous batching over the paged KV cache against the decoder's own ``generate`` run on each
request alone (the independent reference), on tiny random models."""

import shutil

import pytest
import torch

from compress.decoder.generate import generate, left_pad
from compress.decoder.kv import new_cache
from compress.decoder.model import load
from compress.decoder.sampling import Sampling
from compress.errors import CompressError
from compress.serve.engine import Engine
from compress.serve.scheduler import Params
from tests.test_decoder import rel_err, save, tiny_hf, tiny_tokenizer


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(model, tokenizer) of a tiny random Llama."""
    return load(save(tiny_hf(), tmp_path_factory.mktemp("tiny"), tiny_tokenizer()))


def random_prompts(n: int, seed: int, lo: int = 1, hi: int = 40) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randint(2, 300, (int(k),), generator=g).tolist()
        for k in torch.randint(lo, hi, (n,), generator=g)
    ]


def no_leaks(engine: Engine) -> None:
    s = engine.stats()
    assert s["free_blocks"] == s["total_blocks"] and s["running"] == s["waiting"] == 0
    assert all(r == 0 for r in engine.blocks.ref)


@pytest.mark.parametrize("kv", ["full", "fp16"])
def test_batched_greedy_equals_each_alone(tiny, kv):
    """16 requests of 1-39 tokens arriving over 16 steps, 16 blocks of 4 tokens for all of them
    (preemption forced), prompts chunked by an 8-token step budget, two sharing a prefix."""
    model, _ = tiny
    prompts = random_prompts(16, seed=1)
    prompts[5] = prompts[2][:13] + [7, 8]  # shares three full blocks with request 2
    alone = [generate(model, [p], 20, kv=kv, ignore_eos=True).tokens[0] for p in prompts]
    engine = Engine(model, num_blocks=16, block_size=4, max_seqs=8, max_step_tokens=8, kv=kv)
    params = Params(max_tokens=20, ignore_eos=True)
    seqs, events = [], []
    for p in prompts:  # one arrival per step
        seqs.append(engine.add(p, params))
        events += engine.step()
    while engine.has_work():
        events += engine.step()
    assert [s.output for s in seqs] == alone
    assert any(e.token is None and not e.finished for e in events)  # a prompt took several steps
    assert all(s.finish_reason == "length" for s in seqs)
    stats = engine.stats()
    assert stats["preemptions"] > 0 and stats["prefix_hit_tokens"] > 0
    assert stats["generated_tokens"] == 16 * 20
    no_leaks(engine)


def test_prefill_budget_bounds_the_padded_batch():
    """A prefill step's padded batch (rows x widest chunk) stays within ``max_step_tokens``; every
    prompt is fed whole, chunk by chunk, and several prompts share a step."""
    from compress.serve.block_manager import BlockManager
    from compress.serve.scheduler import Scheduler, Sequence

    sch = Scheduler(BlockManager(256, 4), max_seqs=8, max_step_tokens=24)
    seqs = [Sequence(i, p, Params(max_tokens=1)) for i, p in enumerate(random_prompts(12, 3))]
    for s in seqs:
        sch.add(s)
    fed, rows = {}, []
    while sch.waiting or sch.running:
        batch = sch._prefill()
        assert batch and len(batch) * max(n for _, n in batch) <= 24
        rows.append(len(batch))
        for s, n in batch:
            s.computed += n
        for s in [s for s in sch.running if s.pending <= 1]:  # a last token left: decode feeds it
            fed[s.id] = s.computed + s.pending
            sch.retire(s)
    assert fed == {s.id: len(s.tokens) for s in seqs}
    assert max(rows) > 1


def test_paged_forward_matches_contiguous_cache(tiny):
    """One prefill step of three prompts in the paged layout gives each row's last logits as the
    contiguous cache does for the left-padded batch (same model forward, same attention)."""
    model, _ = tiny
    prompts = [[3, 4, 5, 6, 7, 8, 9, 10, 11], [12], [13, 14, 15, 16]]
    engine = Engine(model, num_blocks=8, block_size=4, kv="full")
    seqs = [engine.add(p, Params(max_tokens=1)) for p in prompts]
    batch = engine.scheduler.schedule()
    assert [n for _, n in batch] == [len(p) for p in prompts]
    idx, pos, start = engine.layout(batch)
    with torch.no_grad():
        paged = model(idx, engine.cache, pos=pos, start=start, last=True)[:, -1]
        ids, st = left_pad(prompts, 0, "cpu")
        ref = model(ids, new_cache(model, "full", 3, ids.shape[1]), start=st, last=True)[:, -1]
    assert rel_err(paged, ref) < 1e-5
    for s in seqs:
        engine.abort(s)
    no_leaks(engine)


def test_prefix_cache_hits_are_exact(tiny):
    """A second request sharing two full blocks reads them from the cache: 8 hit tokens, the same
    greedy tokens as alone; a prompt made only of cached blocks still computes its last token."""
    model, _ = tiny
    shared = list(range(20, 29))  # 9 tokens: two full blocks of 4
    a, b, c = shared + [40, 41], shared + [50], shared[:8]
    engine = Engine(model, num_blocks=16, block_size=4, kv="full")
    out = []
    for i, p in enumerate((a, b, c)):
        out.append(engine.generate([p], Params(max_tokens=6, ignore_eos=True))[0].output)
        assert engine.stats()["prefix_hit_tokens"] == [0, 8, 12][i]  # c: its first block only
    assert out == [generate(model, [p], 6, kv="full", ignore_eos=True).tokens[0] for p in (a, b, c)]
    no_leaks(engine)
    off = Engine(model, num_blocks=16, block_size=4, kv="full", prefix_caching=False)
    assert off.generate([a, b], Params(max_tokens=6, ignore_eos=True))[1].output == out[1]
    assert off.stats()["prefix_hit_tokens"] == 0


def test_seeded_sampling_eos_and_stop_strings_as_generate(tiny):
    """Per-request seeded sampling draws what ``generate`` draws alone; EOS and stop strings end a
    request with the same tokens and text."""
    model, tok = tiny
    prompts = [tok("the quick brown").input_ids, tok("fox jumps").input_ids, tok("lazy").input_ids]
    engine = Engine(model, tok, num_blocks=32, block_size=4)
    s = Sampling(temperature=0.9, top_k=50, top_p=0.95, seed=7)
    seqs = [engine.add(p, Params(max_tokens=24, sampling=s)) for p in prompts]
    while engine.has_work():
        engine.step()
    for p, seq in zip(prompts, seqs):
        assert seq.output == generate(model, [p], 24, tok, sampling=s).tokens[0]
    ref = generate(model, [prompts[0]], 30, tok, kv="fp16")
    stop = ref.texts[0][5:8]  # a stop string inside the greedy continuation
    texts = []
    seq = engine.add(prompts[0], Params(max_tokens=30, stop=(stop,)))
    while engine.has_work():
        texts += [e.text for e in engine.step() if e.seq is seq]
    want = generate(model, [prompts[0]], 30, tok, stop=(stop,))
    assert (
        seq.output == want.tokens[0]
        and "".join(texts) == want.texts[0]
        and seq.finish_reason == "stop"
    )
    eos = ref.tokens[0][3]  # make a greedy token the end of sequence
    engine.eos = {eos}
    seq = engine.generate([prompts[0]], Params(max_tokens=30))[0]
    assert seq.output == ref.tokens[0][: ref.tokens[0].index(eos)] and seq.finish_reason == "stop"
    no_leaks(engine)


def test_abort_frees_blocks(tiny):
    model, _ = tiny
    engine = Engine(model, num_blocks=32, block_size=4)
    seqs = [engine.add(p, Params(max_tokens=30)) for p in random_prompts(4, seed=3, lo=10)]
    for _ in range(3):
        engine.step()
    assert engine.stats()["free_blocks"] < 32
    for s in seqs:
        engine.abort(s)
    assert not engine.has_work() and all(s.finish_reason == "abort" for s in seqs)
    no_leaks(engine)


@pytest.mark.parametrize("kind", ["bf16", "int4", "int8"])
def test_weight_formats(kind, tmp_path):
    """The same engine over bfloat16, int4 (RTN-packed) and LLM.int8 weights equals ``generate``
    alone: batched for bf16 and int4; one request at a time for LLM.int8, whose outlier columns
    are picked over the whole batch's activations, so its logits depend on the batch."""
    from compress.methods.quant import llm_int8
    from compress.methods.quant.rtn import pack_model, quantization_config

    hf, qcfg = tiny_hf(), None
    if kind == "int8":
        hf, qcfg = llm_int8.quantize_model(hf, 6.0), llm_int8.quantization_config(6.0)
    elif kind == "int4":
        hf, qcfg = pack_model(hf, 4, 32), quantization_config(4, 32)
    dtype = torch.bfloat16 if kind == "bf16" else torch.float32
    model, _ = load(save(hf, tmp_path, quantization_config=qcfg), dtype=dtype)
    prompts = random_prompts(5, seed=4)
    one = kind == "int8"
    engine = Engine(
        model,
        num_blocks=24,
        block_size=4,
        max_seqs=1 if one else 8,
        max_step_tokens=64 if one else 16,
    )
    seqs = engine.generate(prompts, Params(max_tokens=10, ignore_eos=True))
    if kind == "bf16":  # the paged cache's fused attention sums in another order than generate's
        # cache, and bf16 rounds that apart: the reference is each request served alone
        alone = Engine(model, num_blocks=24, block_size=4, max_seqs=1, max_step_tokens=64)
        want = [
            alone.generate([p], Params(max_tokens=10, ignore_eos=True))[0].output for p in prompts
        ]
        no_leaks(alone)
    else:
        want = [generate(model, [p], 10, ignore_eos=True).tokens[0] for p in prompts]
    assert [s.output for s in seqs] == want
    no_leaks(engine)


def test_latent_attention_folder(tmp_path):
    """An MLA-converted folder (one latent key per token, V inside it) through the paged cache."""
    from tests.test_decoder_attn import convert

    hf, files = convert("mla")
    folder = save(hf, tmp_path, tiny_tokenizer())
    for name, src in files.items():
        shutil.copyfile(src, folder / name)
    model, _ = load(folder)
    prompts = random_prompts(4, seed=5)
    engine = Engine(model, num_blocks=24, block_size=4, max_step_tokens=16, kv="full")
    seqs = engine.generate(prompts, Params(max_tokens=8, ignore_eos=True))
    assert [s.output for s in seqs] == [
        generate(model, [p], 8, kv="full", ignore_eos=True).tokens[0] for p in prompts
    ]
    no_leaks(engine)


def test_bad_requests(tiny):
    model, tok = tiny
    engine = Engine(model, num_blocks=4, block_size=4)
    for prompt, params, match in [
        ([], Params(), "empty"),
        ([5], Params(max_tokens=0), "at least 1"),
        ([5] * 120, Params(max_tokens=20), "context"),
        ([5] * 10, Params(max_tokens=8), "KV blocks"),
        ([5, 300], Params(), "vocabulary"),
        ([5], Params(stop=("x",)), "tokenizer"),
    ]:
        with pytest.raises(CompressError, match=match):
            engine.add(prompt, params)
    with pytest.raises(CompressError, match="paged KIVI"):
        Engine(model, kv="kivi")
    no_leaks(engine)


def test_reused_blocks_forget_their_prefix(tiny):
    """A freed block keeps serving its prefix until the pool hands it out again; then the prefix
    misses, and the output is still that of ``generate`` alone."""
    model, _ = tiny
    a, b = list(range(30, 39)), list(range(60, 73))  # 9 tokens; 13 + 3 fed = all 4 blocks
    engine = Engine(model, num_blocks=4, block_size=4, kv="full")
    params = Params(max_tokens=4, ignore_eos=True)
    ref = generate(model, [a], 4, kv="full", ignore_eos=True).tokens[0]
    assert engine.generate([a], params)[0].output == ref
    assert engine.generate([a], params)[0].output == ref
    assert engine.stats()["prefix_hit_tokens"] == 8  # a's two blocks, still cached
    engine.generate([b], params)  # needs all 4 blocks: a's cached ones are handed out
    assert engine.generate([a], params)[0].output == ref
    assert engine.stats()["prefix_hit_tokens"] == 8  # a missed: its blocks now hold b
    no_leaks(engine)
