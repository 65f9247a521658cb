"""Sliding-window layers in the paged serving cache: each window group has its own block pool and
block tables, and a local group's blocks are freed once no query can see them. Served greedy
tokens against the contiguous caches run on each request alone and against transformers'
eager forward (the independent references), on tiny random Mistral (a window on every layer)
and Gemma 3 (a window on five of six layers) models; the local pools' used blocks stay within
``ceil(w / bs) + 1`` per sequence while the global pool grows with the context."""

import json
import math

import pytest
import torch

from compress.decoder.generate import generate
from compress.decoder.kv.paged import new_paged_cache
from compress.decoder.model import load
from compress.errors import CompressError
from compress.kernels import native
from compress.serve.block_manager import BlockManager
from compress.serve.engine import Engine
from compress.serve.scheduler import Params, Sequence
from compress.testing import SIZES, TOKENS
from tests.conftest import run_bench

W, BS = 8, 4  # window, block size: a window of two blocks
COMMON = dict(SIZES, **TOKENS, vocab_size=300, head_dim=16, max_position_embeddings=256)
COMMON.update(initializer_range=0.2, eos_token_id=None)


def build(family: str, folder):
    import transformers as tf

    if family == "mistral":
        config = tf.MistralConfig(**COMMON, num_hidden_layers=2, sliding_window=W)
    else:  # layer 5 of 6 global, the others local (Gemma 3's pattern)
        config = tf.Gemma3TextConfig(
            **COMMON, num_hidden_layers=6, sliding_window=W, query_pre_attn_scalar=16
        )
    torch.manual_seed(0)
    tf.AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    ref = tf.AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager").eval()
    return load(folder)[0], ref


@pytest.fixture(scope="module", params=["mistral", "gemma3_text"])
def family(request, tmp_path_factory):
    return (request.param, *build(request.param, tmp_path_factory.mktemp(request.param)))


def prompts(n: int, seed: int, lo: int, hi: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randint(1, 300, (int(k),), generator=g).tolist()
        for k in torch.randint(lo, hi, (n,), generator=g)
    ]


def greedy_reference(ref, prompt, n):
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(ref(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt) :]


def serve(engine: Engine, reqs, params, bounded=True):
    """Serve ``reqs`` (one arrival a step), checking after every step that each running
    sequence holds at most ceil(w / bs) + 1 blocks of every local pool (and the pools' used
    blocks at most that times the running sequences); the most global blocks held at once."""
    bm, most_global = engine.blocks, 0
    bound = math.ceil(W / bm.block_size) + 1
    seqs = []

    def check():
        nonlocal most_global
        running = engine.scheduler.running
        for g, pool in enumerate(bm.pools):
            used = pool.num_blocks - len(pool.free)
            if pool.window is None:
                most_global = max(most_global, used)
            elif bounded:
                assert all(bm.held(s)[g] <= bound for s in running)
                assert used <= bound * len(running)

    for p in reqs:
        seqs.append(engine.add(p, params))
        engine.step()
        check()
    while engine.has_work():
        engine.step()
        check()
    return seqs, most_global


def no_leaks(engine: Engine) -> None:
    s = engine.stats()
    assert s["free_blocks"] == s["total_blocks"] and s["running"] == s["waiting"] == 0
    assert all(r == 0 for r in engine.blocks.ref)


@pytest.mark.parametrize("kv", ["full", "fp16"])
def test_served_past_the_window_as_alone(family, kv):
    """Six requests of 5-30 tokens, 40 greedy tokens each (five windows past), decoded in one
    batch with 4-token prefill chunks: the tokens of the contiguous cache alone, and the local
    pools bounded by the window while the global one grows."""
    name, model, _ = family
    reqs = prompts(6, seed=1, lo=5, hi=30)
    params = Params(max_tokens=40, ignore_eos=True)
    engine = Engine(model, num_blocks=96, block_size=BS, max_seqs=6, max_step_tokens=8, kv=kv)
    seqs, most_global = serve(engine, reqs, params)
    alone = [generate(model, [p], 40, kv=kv, ignore_eos=True).tokens[0] for p in reqs]
    assert [s.output for s in seqs] == alone
    windows = [p.window for p in engine.blocks.pools]
    assert windows == ([None, W] if name == "gemma3_text" else [W])
    if name == "gemma3_text":
        assert most_global > len(reqs) * (math.ceil(W / BS) + 1)  # global blocks grow
    no_leaks(engine)


def test_blocks_larger_than_the_window(family):
    """Blocks of 16 tokens over a window of 8: a block is freed only once its last position
    leaves the window; at most two blocks per local table, the tokens as alone."""
    name, model, _ = family
    reqs = prompts(3, seed=8, lo=5, hi=40)
    engine = Engine(model, num_blocks=32, block_size=16, max_seqs=3, max_step_tokens=12, kv="full")
    seqs, _ = serve(engine, reqs, Params(max_tokens=40, ignore_eos=True))
    assert [s.output for s in seqs] == [
        generate(model, [p], 40, kv="full", ignore_eos=True).tokens[0] for p in reqs
    ]
    no_leaks(engine)


def test_matches_transformers(family):
    """Two requests, 30 greedy tokens past a 20-token prompt: transformers' eager greedy tokens."""
    name, model, ref = family
    reqs = prompts(2, seed=2, lo=18, hi=22)
    engine = Engine(model, num_blocks=64, block_size=BS, max_seqs=2, kv="full")
    seqs, _ = serve(engine, reqs, Params(max_tokens=30, ignore_eos=True))
    assert [s.output for s in seqs] == [greedy_reference(ref, p, 30) for p in reqs]
    no_leaks(engine)


def test_small_local_pool_preempts_and_prefix_hits(family):
    """A local pool of 10 blocks (room for two sequences' windows and chunks): sequences are
    preempted and recomputed, prompts sharing 20 tokens (past the window) hit the prefix cache
    in every pool, and the tokens are still those of each request alone."""
    name, model, _ = family
    shared = prompts(1, seed=3, lo=20, hi=21)[0]
    reqs = [shared + p for p in prompts(5, seed=4, lo=1, hi=6)]
    params = Params(max_tokens=24, ignore_eos=True)
    engine = Engine(
        model, num_blocks=64, block_size=BS, max_seqs=5, max_step_tokens=8, local_blocks=10
    )
    assert [p.num_blocks for p in engine.blocks.pools if p.window] == [10]
    first = engine.generate(reqs[:1], params)  # its blocks stay registered
    seqs, _ = serve(engine, reqs[1:], params, bounded=False)
    alone = [generate(model, [p], 24, kv="fp16", ignore_eos=True).tokens[0] for p in reqs]
    assert [s.output for s in first + seqs] == alone
    stats = engine.stats()
    assert stats["preemptions"] > 0 and stats["prefix_hit_tokens"] >= 4 * 20
    no_leaks(engine)
    with pytest.raises(CompressError, match="window's pool"):
        Engine(model, num_blocks=64, block_size=BS, max_step_tokens=32, local_blocks=4).add(
            [5] * 40, params
        )


def test_local_pool_bytes(family):
    """The local slots' pool is sized by the window, not by num_blocks: nbytes is the analytic
    sum over groups of blocks x slots x block_size x (K, V) x heads x head_dim x 2 bytes."""
    name, model, _ = family
    engine = Engine(model, num_blocks=512, block_size=BS, max_seqs=4, max_step_tokens=16)
    per_slot_block = BS * 2 * 2 * 16 * 2
    local = 4 * (math.ceil(W / BS) + 2) + 16 // BS
    n_local = 5 if name == "gemma3_text" else 2
    n_global = 6 - n_local if name == "gemma3_text" else 0
    want = (n_global * 512 + n_local * local) * per_slot_block
    assert engine.cache.nbytes() == want
    assert [p.num_blocks for p in engine.blocks.pools] == [512] * (n_global > 0) + [local]


def test_block_manager_frees_dead_local_blocks():
    """A local group of window 8 over blocks of 4: block i is freed once c - 8 >= 4i + 3; the
    global group keeps every block; a prefix match restores only the live local blocks."""
    bm = BlockManager([32, 8], BS, windows=[None, W])
    seq = Sequence(0, list(range(1, 41)), Params(max_tokens=1))
    for c in range(1, 40):
        assert bm.can_grow(seq, c)
        bm.grow(seq, c)
        seq.computed = c
        bm.register(seq)
        glob, loc = seq.block_tables
        assert len(glob) == len(loc) == math.ceil(c / BS) and None not in glob
        dead = [i for i in range(len(loc)) if 4 * i + 3 <= c - W]
        assert [i for i, b in enumerate(loc) if b is None] == dead
    other = Sequence(1, list(range(1, 41)) + [7], Params(max_tokens=1))
    bm.match_prefix(other)
    assert other.computed == 36  # nine full blocks registered (the 40th token was not computed)
    glob, loc = other.block_tables
    assert glob == seq.block_tables[0][:9]
    assert [b is None for b in loc] == [True] * 7 + [False] * 2  # live at 36: blocks 7 and 8
    bm.release(seq)
    bm.release(other)
    assert all(r == 0 for r in bm.ref) and bm.num_free == 40


def test_metrics_and_flag(family):
    """``/metrics`` reports each local pool by window; ``--local-blocks 0`` is refused before
    the model loads."""
    from starlette.testclient import TestClient

    from compress.serve.__main__ import check_arguments, parse_args
    from compress.serve.app import create_app
    from compress.serve.worker import Worker

    name, model, _ = family
    engine = Engine(model, num_blocks=64, block_size=BS, max_seqs=2, local_blocks=12)
    seq = engine.add(list(range(1, 30)), Params(max_tokens=8))
    for _ in range(6):
        engine.step()
    text = TestClient(create_app(Worker(engine), None, "w")).get("/metrics").text
    rows = dict(line.rsplit(" ", 1) for line in text.splitlines())
    used = 12 - int(rows[f'compress_kv_local_blocks_free{{window="{W}"}}'])
    assert rows[f'compress_kv_local_blocks_total{{window="{W}"}}'] == "12"
    assert used == engine.blocks.held(seq)[-1] and 0 < used <= math.ceil(W / BS) + 1
    engine.abort(seq)
    no_leaks(engine)
    with pytest.raises(CompressError, match="--local-blocks 0"):
        check_arguments(parse_args(["run", "--local-blocks", "0"]))


def rel(a, b) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.skipif(not native.library(), reason="the C++ kernels did not build")
def test_fixed_order_window_attention(family):
    """The batch-invariant kernel's window rows (``window_keys``) against the masked fused
    attention over the same pools, every step of a batched run past the window; the greedy
    tokens are still those of each request alone."""
    name, model, _ = family
    reqs = prompts(4, seed=5, lo=5, hi=25)
    engine = Engine(model, num_blocks=64, block_size=BS, max_seqs=4, max_step_tokens=8, kv="full")
    inv = new_paged_cache(model, engine.cache.group_blocks, BS, "full", invariant=True)
    inv.k, inv.v = engine.cache.k, engine.cache.v
    bind, forward, errs = engine.cache.bind, engine.model, []

    def bind_both(*a):
        bind(*a)
        inv.bind(*a)

    def both(idx, cache, **kw):
        out = forward(idx, cache, **kw)
        errs.append(rel(forward(idx, inv, **kw), out))  # writes the slots again, within 1e-7
        return out

    both.spec = model.spec  # the engine checks requests against it
    engine.cache.bind, engine.model = bind_both, both
    seqs, _ = serve(engine, reqs, Params(max_tokens=30, ignore_eos=True))
    assert len(errs) > 30 and max(errs) < 1e-5
    alone = [generate(model, [p], 30, kv="full", ignore_eos=True).tokens[0] for p in reqs]
    assert [s.output for s in seqs] == alone


@pytest.mark.skipif(not native.library(), reason="the C++ kernels did not build")
def test_batch_invariant_windowed_model(tmp_path):
    """A W4A8 Mistral (window 8) served with batch invariance: six concurrent greedy requests
    running well past the window give the tokens of the same requests one at a time."""
    import transformers as tf

    from compress.kernels.w4a8_cpu import use
    from compress.methods.quant.rtn import pack_model, quantization_config
    from tests.test_decoder import save, tiny_tokenizer

    torch.manual_seed(1)
    config = tf.MistralConfig(**dict(COMMON, vocab_size=320), num_hidden_layers=2, sliding_window=W)
    hf = pack_model(tf.AutoModelForCausalLM.from_config(config), 4, 32)
    folder = save(hf, tmp_path / "q4", tiny_tokenizer(), quantization_config(4, 32))
    model, _ = load(folder, kernel="w4a8", lean=True, head="int8")
    use(model, "w4a8", every_m=True)
    reqs, params = prompts(6, seed=6, lo=3, hi=30), Params(max_tokens=24, ignore_eos=True)
    batched = Engine(model, num_blocks=96, block_size=BS, max_seqs=6, max_step_tokens=24,
                     batch_invariant=True).generate(reqs, params)  # fmt: skip
    alone = [
        Engine(model, num_blocks=32, block_size=BS, batch_invariant=True).generate([p], params)[0]
        for p in reqs
    ]
    assert [s.output for s in batched] == [s.output for s in alone]
    assert len({tuple(s.output) for s in alone}) > 3


def test_held_bytes(family):
    """``Engine.kv_bytes`` at 59 tokens: the global slots' blocks for all of them, the local
    slots' for the window only (analytic)."""
    name, model, _ = family
    engine = Engine(model, num_blocks=64, block_size=BS)
    seq = engine.add(prompts(1, seed=7, lo=50, hi=51)[0], Params(max_tokens=20))
    while len(seq.output) < 10:
        engine.step()
    c, slot_block = seq.computed, BS * 2 * 2 * 16 * 2  # K and V, 2 heads of 16, fp16
    n_local = 5 if name == "gemma3_text" else 2
    live = math.ceil(c / BS) - (c - W + 1) // BS
    want = (6 - n_local if name == "gemma3_text" else 0) * math.ceil(c / BS) + n_local * live
    assert c == 59 and engine.kv_bytes(seq) == want * slot_block
    engine.abort(seq)


def test_bytes_bench_quick(tmp_path):
    """The bench script's quick run (a tiny Gemma 3 at 300 tokens): the held bytes within the
    bound and under the all-global figure, the pools smaller than one pool for every slot."""
    out = tmp_path / "bytes.json"
    run_bench("paged_window_bytes", "--quick", "--json", out)
    res = json.loads(out.read_text())
    assert res["measured_bytes"] <= res["bound_bytes"] < res["all_global_bytes"]
    assert res["pool_bytes"] < res["pool_bytes_all_global"]
