"""Sliding-window attention in every KV cache against float64 attention over everything appended,
masked as transformers masks a window (the query at p sees p - w < k <= p); bounded bytes; rollback
(speculative decoding) across the window; and the decoder's generation past Mistral's window."""

import json

import pytest
import torch

from compress.arch.spec import spec_of
from compress.decoder.generate import generate
from compress.decoder.kv import KVLayout, make_cache, new_cache, static_cache
from compress.decoder.kv.fp16 import FP16Cache
from compress.decoder.speculative.generate import speculative_generate
from compress.errors import CompressError
from compress.io.checkpoint import read_config
from compress.testing import tiny_tokenizer
from tests.conftest import run_bench
from tests.family_models import family_model

B, HKV, H, D = 2, 2, 4, 32
W, LOOK = 8, 2
WINDOWS = [W, None]  # slot 0 local, slot 1 global


def reference(q, keys, values, qpos, start, window, scale):
    """float64 softmax(q K^T * scale + mask) V over all ``keys [B, Hkv, L, D]`` at positions 0..L-1."""
    g = q.shape[1] // keys.shape[1]
    k = keys.double().repeat_interleave(g, 1)
    v = values.double().repeat_interleave(g, 1)
    s = q.double() @ k.transpose(-1, -2) * scale
    kp = torch.arange(keys.shape[2])
    m = kp[None, :] > qpos[:, None]
    if window is not None:
        m = m | (kp[None, :] <= qpos[:, None] - window)
    m = m[None, None] | (kp < start.view(-1, 1, 1, 1))
    return s.masked_fill(m, float("-inf")).softmax(-1) @ v


def run(cache, chunks, start, tol, rollback_at=None, seed=0):
    windows = cache.windows
    """Append ``chunks`` (token counts) to both slots, attending after each; compare the queries
    that are not padding with :func:`reference` (``tol``: one bound, or (local, global): a
    compressed cache's global slot carries its compression error). ``rollback_at``: {chunk index: tokens to drop after it}."""
    g = torch.Generator().manual_seed(seed)
    held = [torch.zeros(B, HKV, 0, D, dtype=torch.float64) for _ in range(2)]
    vals = [torch.zeros(B, HKV, 0, D, dtype=torch.float64) for _ in range(2)]
    n = 0
    for i, T in enumerate(chunks):
        pos = torch.arange(n, n + T)
        for layer in range(2):
            k, v = (torch.randn(B, HKV, T, D, generator=g) for _ in range(2))
            q = torch.randn(B, H, T, D, generator=g)
            cache.append(layer, k, v, pos)
            held[layer] = torch.cat([held[layer], k.double()], 2)
            vals[layer] = torch.cat([vals[layer], v.double()], 2)
            out = cache.attend(layer, q, pos, start)
            want = reference(q, held[layer], vals[layer], pos, start, windows[layer], D**-0.5)
            for b in range(B):
                real = pos >= start[b]
                got, ref = out[b, :, real].double(), want[b, :, real]
                err = ((got - ref).norm() / ref.norm()).item()
                limit = tol if isinstance(tol, float) else tol[layer]
                assert err < limit, (i, layer, b, err)
        n += T
        drop = (rollback_at or {}).get(i)
        if drop:
            n -= drop
            cache.rollback(n)
            held = [t[:, :, :n] for t in held]
            vals = [t[:, :, :n] for t in vals]
    return n


CHUNKS = [21, 1, 1, 3, 1, 12, 1, 1, 1, 1]
START = torch.tensor([0, 5])


@pytest.mark.parametrize(
    "kind, opts, tol",
    [
        ("full", {}, 1e-5),
        ("fp16", {}, 2e-3),
        ("kivi", {"bits": 4, "residual": 16, "group": 32}, (2e-3, 0.1)),
        ("packkv", {"residual": 16}, (2e-3, 0.3)),
    ],
)
def test_windowed_attention_matches_float64(kind, opts, tol):
    """Long chunks (the ring keeps the old keys aside), single steps, a chunk that fits the ring."""
    cache = make_cache(kind, KVLayout(2, HKV, D, windows=WINDOWS), B, 200, lookahead=LOOK, **opts)
    run(cache, CHUNKS, START, tol)


def test_local_layers_of_compressed_caches_are_exact_fp16():
    """KIVI and PackKV keep a local layer's window in fp16 and compress nothing of it."""
    for kind in ("kivi", "packkv"):
        cache = make_cache(
            kind, KVLayout(2, HKV, D, windows=[W, W]), B, 200, lookahead=LOOK, residual=16
        )
        run(cache, CHUNKS, START, 2e-3)
        assert cache.ncomp == [0, 0] and all(w.shape[2] <= W + LOOK for w in cache.win_k)


def test_query_blocks_and_windowed_layers_without_a_ring(monkeypatch):
    """A prompt longer than QUERY_BLOCK in a ring layer, and a windowed layer whose cache is no
    longer than window + lookahead (no ring; the window is a mask over its slots)."""
    monkeypatch.setattr(FP16Cache, "QUERY_BLOCK", 4)
    run(
        make_cache("full", KVLayout(2, HKV, D, windows=WINDOWS), B, 200, lookahead=LOOK),
        CHUNKS,
        START,
        1e-5,
    )
    small = make_cache("full", KVLayout(2, HKV, D, windows=[W, None]), B, 10, lookahead=LOOK)
    assert not small.ring(0)
    run(small, [7, 1, 1, 1], START, 1e-5)


def test_static_cache_ring():
    """The compiled step's static cache: one token a step over all ring slots."""
    cache = static_cache(
        make_cache("full", KVLayout(2, HKV, D, windows=WINDOWS), B, 256, lookahead=LOOK)
    )
    run(cache, [13] + [1] * 20, START, 1e-5)


@pytest.mark.parametrize("kind", ["full", "fp16", "kivi"])
def test_rollback_within_lookahead(kind):
    """Speculative verification appends gamma + 1 = LOOK + 1 tokens and drops up to gamma."""
    opts = {"residual": 16} if kind == "kivi" else {}
    cache = make_cache(kind, KVLayout(2, HKV, D, windows=WINDOWS), B, 200, lookahead=LOOK, **opts)
    chunks = [20, 3, 3, 3, 3, 1, 3]
    run(
        cache,
        chunks,
        START,
        (2e-3, 0.1) if kind == "kivi" else 2e-3,
        rollback_at={1: 2, 2: 1, 3: 2, 6: 2},
    )
    if kind == "kivi":  # its window keeps the whole last append: a rollback of it always works
        return
    with pytest.raises(CompressError, match="lookahead"):
        cache.append(0, *(torch.randn(B, HKV, 5, D) for _ in range(2)))
        cache.append(1, *(torch.randn(B, HKV, 5, D) for _ in range(2)))
        cache.rollback(cache.length - 5)


def test_bytes_bounded_for_local_layers():
    """At 150 tokens a local slot holds window + lookahead tokens; a global one all 150."""
    per_token = B * HKV * 2 * D * 2  # fp16 K and V
    for kind, opts in (("fp16", {}), ("kivi", {"residual": 16}), ("packkv", {"residual": 16})):
        cache = make_cache(
            kind, KVLayout(2, HKV, D, windows=[W, W]), B, 160, lookahead=LOOK, **opts
        )
        for T in [100] + [1] * 50:
            for layer in range(2):
                cache.append(layer, *(torch.randn(B, HKV, T, D) for _ in range(2)))
        cache.settle()
        assert cache.length == 150
        assert cache.nbytes() <= 2 * (W + LOOK) * per_token
    fp16 = make_cache("fp16", KVLayout(2, HKV, D, windows=[W, None]), B, 160)
    for layer in range(2):
        fp16.append(layer, *(torch.randn(B, HKV, 150, D) for _ in range(2)))
    assert fp16.nbytes() == (W + 150) * per_token


def test_bad_windows_refused():
    with pytest.raises(CompressError, match="one sliding window"):
        make_cache("fp16", KVLayout(2, HKV, D, windows=[4]), 1, 16)
    with pytest.raises(CompressError, match="one sliding window"):
        make_cache("fp16", KVLayout(2, HKV, D, windows=[0, None]), 1, 16)


@pytest.fixture(scope="module")
def mistral(tmp_path_factory):
    """(ours, transformers') tiny Mistral with a 16-token window, from one saved folder."""
    from transformers import AutoModelForCausalLM, MistralConfig

    from compress.decoder.model import load

    config = MistralConfig(
        vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=16,
        max_position_embeddings=256, initializer_range=0.2, eos_token_id=None,
        bos_token_id=None, pad_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("mistral")
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    ref = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager").eval()
    return load(folder)[0], ref


def greedy_reference(ref, prompt, n):
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(ref(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt) :]


def test_generate_past_the_window(mistral):
    """``generate`` no longer refuses a sequence longer than the window: its greedy tokens are
    transformers' (which masks the window), and its fp16 cache holds window tokens."""
    ours, ref = mistral
    prompt = torch.randint(1, 300, (30,), generator=torch.Generator().manual_seed(3)).tolist()
    want = greedy_reference(ref, prompt, 40)
    res = generate(ours, [prompt], 40, kv="full", ignore_eos=True)
    assert res.tokens[0] == want
    fp16 = generate(ours, [prompt], 40, kv="fp16", ignore_eos=True)
    assert fp16.kv_bytes == 2 * 16 * 2 * 2 * 16 * 2  # layers x window x (K, V) x heads x D x 2 B


def test_speculative_rollback_across_the_window(mistral):
    """Self-speculative drafts (rollbacks of the shared cache) and a draft model with its own
    cache, gamma 4 over a 16-token window: greedy output equals plain greedy decoding."""
    from compress.decoder.speculative.drafts import LayerSkipDraft

    ours, _ = mistral
    prompt = torch.randint(1, 300, (30,), generator=torch.Generator().manual_seed(4)).tolist()
    plain = generate(ours, [prompt], 40, kv="full", ignore_eos=True).tokens[0]
    for draft in (LayerSkipDraft(ours, [1]), ours):
        for kv in ("full", "fp16"):
            res = speculative_generate(
                ours, [prompt], 40, kv=kv, ignore_eos=True, draft=draft, gamma=4
            )
            if kv == "full":
                assert res.tokens[0] == plain
            assert len(res.tokens[0]) == 40 and res.rounds < 40


def test_gemma_like_kv_bytes(tmp_path):
    """A model with five local layers of six: at 300 tokens the fp16 cache holds 5 x window + 300
    tokens' K/V against 6 x 300 with every layer global (analytic)."""
    from transformers import AutoModelForCausalLM, Gemma3TextConfig

    from compress.decoder.model import load

    kw = dict(
        vocab_size=64, hidden_size=64, intermediate_size=64, num_hidden_layers=6,
        num_attention_heads=2, num_key_value_heads=1, head_dim=32, max_position_embeddings=512,
        pad_token_id=0, eos_token_id=None, bos_token_id=None,
    )  # fmt: skip
    per = 2 * 32 * 2  # K and V, one KV head of 32, fp16
    for window, want in ((32, (5 * 32 + 300) * per), (None, 6 * 300 * per)):
        cfg = Gemma3TextConfig(**kw, sliding_window=window or 512)
        if window is None:
            cfg.layer_types = ["full_attention"] * 6
        folder = tmp_path / str(window)
        AutoModelForCausalLM.from_config(cfg).save_pretrained(folder)
        model, _ = load(folder)
        cache = new_cache(model, "fp16", 1, 310)
        with torch.no_grad():
            model(torch.randint(1, 64, (1, 300)), cache)
        assert cache.nbytes() == want


def test_window_kv_bench_measures_the_bounded_cache(tmp_path):
    """``eval/bench/bench_window_kv.py``: the fp16 cache's bytes per token of a windowed model
    after a prompt past its window match the analytic figure (per layer, min(tokens, window)
    slots of K and V), and the all-global copy's match theirs."""
    folder, out = tmp_path / "gemma", tmp_path / "window.json"
    family_model("gemma3_text").save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    run_bench("bench_window_kv", "--folder", folder, "--prompt-tokens", 96, "--json", out)
    got = json.loads(out.read_text())
    spec = spec_of(read_config(folder)[0])
    assert sum(layer.window is not None for layer in spec.layers) == 5
    per_slot = 2 * spec.n_kv_heads * spec.head_dim * 2
    a = sum(min(96, layer.window or 96) for layer in spec.layers) * per_slot / 96
    ag = len(spec.layers) * per_slot
    assert (got["analytic"], got["analytic_all_global"]) == pytest.approx((a, ag))
    assert a < ag / 2  # five of six layers keep 16 of 96 tokens
    local, full = got["rows"][0]["measured"], got["rows"][0]["measured_all_global"]
    # the caches hold the prompt plus the new tokens (and a local ring its window + lookahead)
    assert a <= local < a * 1.15 and ag <= full < ag * 1.15, (a, local, ag, full)
