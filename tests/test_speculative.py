"""Speculative decoding (compress.decoder.speculative.generate) on tiny random Llamas: greedy output
identical to the target's own, the sampling rule's output distribution equal to the target's
(chi-square), KV cache rollback, self-speculative drafts, bandits and bad input."""

import copy
import json

import pytest
import torch

from compress.decoder.__main__ import main as cli
from compress.decoder.generate import generate
from compress.decoder.kv import KVLayout, make_cache
from compress.decoder.model import load
from compress.decoder.sampling import Sampling, logits_to_probs
from compress.decoder.speculative.bandit import UCB1, Unimodal, self_bandit
from compress.decoder.speculative.drafts import (
    LayerSkipDraft,
    ModelDraft,
    confidence,
    load_draft,
    run_drafts,
)
from compress.decoder.speculative.gamma import AutoGamma, Fixed
from compress.decoder.speculative.generate import speculative_generate, verify
from compress.decoder.speculative.layer_skip import (
    agreement,
    parse_layers,
    searched_skip,
    skip_file,
    unified_skip,
)
from compress.errors import CompressError
from compress.eval.ties import first_divergence_is_tie
from tests.conftest import make_tiny_model, run_bench
from tests.test_decoder import save, tiny_hf, tiny_tokenizer

PROMPT = [[5, 17, 33, 2, 99, 7, 8]]


def noisy_copy(hf, scale: float, seed: int = 1):
    """``hf`` with N(0, scale^2) added to every weight: a draft that agrees some of the time."""
    draft = copy.deepcopy(hf)
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn_like(p) * scale)
    return draft


def loaded_pair(root, layers: int = 3, noise: float = 0.005):
    """(target, noisy draft, tokenizer) loaded from run folders under ``root``: a tiny random
    model of ``layers`` layers and its ``noisy_copy``."""
    tok, hf = tiny_tokenizer(), tiny_hf(num_hidden_layers=layers)
    target, tok = load(save(hf, root / "target", tok))
    draft, _ = load(save(noisy_copy(hf, noise), root / "draft", tok))
    return target, draft, tok


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """(target folder, target, noisy draft folder, draft): 4 layers, α about 0.4 at γ = 4."""
    root, tok = tmp_path_factory.mktemp("spec"), tiny_tokenizer()
    hf = tiny_hf(num_hidden_layers=4)
    target_dir = save(hf, root / "target", tok)
    draft_dir = save(noisy_copy(hf, 0.005), root / "draft", tok)
    return target_dir, load(target_dir)[0], draft_dir, load(draft_dir)[0]


@pytest.mark.parametrize("kv", ["fp16", "full"])
@pytest.mark.parametrize("which", ["noisy", "itself", "self-skip", "auto"])
def test_greedy_is_the_targets_greedy(pair, kv, which):
    _, target, _, noisy = pair
    draft, gamma = {
        "noisy": (noisy, 4),
        "itself": (target, 3),
        "auto": (noisy, "auto"),
        "self-skip": (LayerSkipDraft(target, [1, 2]), 2),
    }[which]
    ref = generate(target, PROMPT, 64, kv=kv, ignore_eos=True)
    r = speculative_generate(target, PROMPT, 64, kv=kv, ignore_eos=True, draft=draft, gamma=gamma)
    assert r.tokens == ref.tokens
    assert r.drafted > 0 and r.decode_steps == 63
    if which == "itself":
        assert r.acceptance == 1.0 and r.tokens_per_pass > 3.5  # 4 per pass but the last
    else:
        assert 0.05 < r.acceptance < 0.9  # the draft disagrees often
    assert r.tokens_per_pass == pytest.approx(r.decode_steps / r.rounds)


@pytest.mark.parametrize("kv,opts", [("packkv", dict(residual=80)), ("kivi", dict(residual=80))])
def test_greedy_with_a_compressed_window_cache(tmp_path, kv, opts):
    """Before any token leaves the fp16 window, a KIVI/PackKV target is token-identical to its own
    greedy decoding: every rollback happened inside the window."""
    hf = tiny_hf(num_hidden_layers=3, head_dim=32, hidden_size=128)
    target = load(save(hf, tmp_path / "t"))[0]
    draft = load(save(noisy_copy(hf, 0.005), tmp_path / "d"))[0]
    ref = generate(target, PROMPT, 60, kv=kv, kv_opts=opts, ignore_eos=True)
    r = speculative_generate(
        target, PROMPT, 60, kv=kv, kv_opts=opts, ignore_eos=True, draft=draft, gamma=4
    )
    assert r.tokens == ref.tokens and 0 < r.accepted < r.drafted
    skip = speculative_generate(
        target,
        PROMPT,
        60,
        kv=kv,
        kv_opts=opts,
        ignore_eos=True,
        draft=LayerSkipDraft(target, [1]),
        gamma=3,
    )  # drafts in the cache
    assert skip.tokens == ref.tokens and 0 < skip.accepted < skip.drafted
    for d in (draft, LayerSkipDraft(target, [1])):  # tokens compressed between rounds
        long = speculative_generate(
            target, PROMPT, 120, kv=kv, kv_opts=dict(residual=16), ignore_eos=True, draft=d, gamma=4
        )
        assert len(long.tokens[0]) == 120 and long.rounds < 119


def chi_square_p(observed: torch.Tensor, expected: torch.Tensor) -> float:
    """Pearson's test p-value, cells with expected count < 5 pooled; sf = Q(dof/2, x/2)."""
    small = expected < 5
    obs = torch.cat([observed[~small], observed[small].sum()[None]]).double()
    exp = torch.cat([expected[~small], expected[small].sum()[None]]).double()
    keep = exp > 0
    stat = ((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum()
    dof = int(keep.sum()) - 1
    return torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), stat / 2).item()


def all_contexts(model, prefix: list[int], depth: int, sampling: Sampling) -> torch.Tensor:
    """Probabilities after ``prefix + s`` for every continuation s of length <= depth:
    ``[V^depth, depth + 1, V]``, row = s in base V (first token most significant)."""
    from compress.decoder.kv import new_cache

    V = model.config.vocab_size
    n = V**depth
    s = torch.stack([torch.arange(n) // V ** (depth - 1 - j) % V for j in range(depth)], 1)
    ids = torch.cat([torch.tensor(prefix).expand(n, -1), s], 1)
    logits = model(ids, new_cache(model, "full", n, ids.shape[1]))[:, len(prefix) - 1 :]
    return logits_to_probs(logits.reshape(-1, V), sampling).view(n, depth + 1, V).double()


def simulate(target_tab, draft_tab, V, gamma, sampling, rows, gen):
    """The first two tokens of speculative decoding over ``rows`` independent runs, with the
    probabilities of every context tabulated: rounds of ``verify`` until each row has two."""
    depth = target_tab.shape[1] - 1

    def row_of(ctx):  # table row whose first tokens are ctx (the rest 0)
        code = torch.zeros(ctx.shape[0], dtype=torch.long)
        for j in range(ctx.shape[1]):
            code += ctx[:, j] * V ** (depth - 1 - j)
        return code

    def one_round(ctx):
        R, c = ctx.shape
        drafts, p = torch.empty(R, 0, dtype=torch.long), []
        for i in range(gamma):
            pi = draft_tab[row_of(torch.cat([ctx, drafts], 1)), c + i]
            p.append(pi)
            drafts = torch.cat([drafts, torch.multinomial(pi, 1, generator=gen)], 1)
        code = row_of(torch.cat([ctx, drafts], 1))
        q = target_tab[code][:, c : c + gamma + 1]
        n, nxt = verify(drafts, torch.stack(p, 1), q, sampling, gen)
        slot = torch.arange(gamma + 1)
        padded = torch.cat([drafts, drafts[:, :1]], 1)
        after = torch.where(slot == n[:, None], nxt[:, None], -1)
        emitted = torch.where(slot < n[:, None], padded, after)
        return emitted, n + 1

    ctx = torch.empty(rows, 0, dtype=torch.long)
    out, got = one_round(ctx)
    first = out[:, 0]
    second = torch.where(got >= 2, out[:, 1], -1)
    need = got < 2
    out2, _ = one_round(first[need][:, None])
    second[need] = out2[:, 0]
    return first, second, got


def vocab8_pair(folder):
    """(target, draft): a 2-layer and an unrelated 1-layer random Llama over 8 tokens."""
    from transformers import LlamaConfig, LlamaForCausalLM

    kw = dict(vocab_size=8, hidden_size=32, intermediate_size=64, head_dim=16)
    kw.update(num_attention_heads=2, num_key_value_heads=1, initializer_range=0.2)
    target = load(save(tiny_hf(num_hidden_layers=2, **kw), folder / "t"))[0]
    torch.manual_seed(7)
    other = LlamaForCausalLM(
        LlamaConfig(num_hidden_layers=1, max_position_embeddings=64, tie_word_embeddings=True, **kw)
    ).eval()
    return target, load(save(other, folder / "d"))[0]


@pytest.mark.parametrize("gamma", [1, 4])
@pytest.mark.parametrize(
    "sampling", [Sampling(1.0), Sampling(0.7, top_k=5, top_p=0.95)], ids=["t1", "t0.7-topk-topp"]
)
def test_sampling_matches_the_target_distribution(tmp_path, gamma, sampling):
    V, rows, prefix = 8, 20000, [3, 1, 4, 1, 5]
    target, draft = vocab8_pair(tmp_path)
    depth = gamma + 1
    with torch.no_grad():
        qt = all_contexts(target, prefix, depth, sampling)
        pt = all_contexts(draft, prefix, depth, sampling)
    tv = 0.5 * (qt[0, 0] - pt[0, 0]).abs().sum()
    assert tv > 0.2  # the draft disagrees often
    gen = torch.Generator().manual_seed(0)
    first, second, got = simulate(qt, pt, V, gamma, sampling, rows, gen)
    observed = torch.bincount(first * V + second, minlength=V * V).double()
    expected = (qt[0, 0][:, None] * qt[torch.arange(V) * V ** (depth - 1), 1]).reshape(-1) * rows
    assert chi_square_p(observed, expected) > 0.01
    assert (got == 1).any() and (got >= 2).any()  # both rejections and acceptances happened
    # the test has power: taking every draft unverified gives the draft's distribution, rejected
    drafts = torch.multinomial(pt[0, 0], rows, replacement=True, generator=gen)
    wrong = torch.bincount(drafts, minlength=V)
    assert chi_square_p(wrong.double(), qt[0, 0] * rows) < 1e-6


@pytest.mark.slow
def test_sampled_generation_end_to_end(tmp_path):
    """speculative_generate itself, sampled: tokens 2 and 3 (the first round's, γ = 2, after the
    prefill's token 1) follow the target's joint distribution (chi-square, 6,000 runs)."""
    V, runs, prefix = 8, 6000, [3, 1, 4, 1, 5]
    target, draft = vocab8_pair(tmp_path)
    sampling = Sampling(1.0)
    with torch.no_grad():
        q = all_contexts(target, prefix, 3, sampling)  # [512, 4, V]
    # P(t2, t3) = sum_t1 q(t1) q(t2 | t1) q(t3 | t1, t2)
    t1, t2 = torch.arange(V)[:, None], torch.arange(V)[None, :]
    q1, q2 = q[torch.arange(V) * V * V, 1], q[t1 * V * V + t2 * V, 2]  # [t1, t2], [t1, t2, t3]
    joint = q[0, 0][:, None, None] * q1[:, :, None] * q2
    expected = joint.sum(0).reshape(-1) * runs
    torch.manual_seed(0)
    pairs, drafted = [], 0
    for _ in range(runs):
        r = speculative_generate(
            target, [prefix], 4, sampling=sampling, ignore_eos=True, draft=draft, gamma=2
        )
        pairs.append(r.tokens[0][1] * V + r.tokens[0][2])
        drafted += r.drafted
    observed = torch.bincount(torch.tensor(pairs), minlength=V * V).double()
    assert chi_square_p(observed, expected) > 0.01 and drafted >= 2 * runs


def test_sampled_self_draft_accepts_everything(pair):
    _, target, _, _ = pair
    r = speculative_generate(
        target, PROMPT, 40, sampling=Sampling(1.0, seed=3), ignore_eos=True, draft=target, gamma=4
    )
    assert r.acceptance > 0.99 and len(r.tokens[0]) == 40


def attend_all(cache, q, L):
    return torch.stack(
        [cache.attend(layer, q, torch.tensor([L - 1])) for layer in range(cache.n_layers)]
    )


@pytest.mark.parametrize("kind", ["fp16", "full"])
def test_rollback_by_position(kind):
    torch.manual_seed(0)
    k, v, q = torch.randn(2, 1, 2, 40, 32), torch.randn(2, 1, 2, 40, 32), torch.randn(1, 4, 1, 32)
    spec, ref = (make_cache(kind, KVLayout(2, 2, 32), 1, 64) for _ in range(2))
    for cache, chunks in ((spec, [(0, 20), (20, 30)]), (ref, [(0, 25)])):
        for a, b in chunks:
            for layer in range(2):
                cache.append(layer, k[layer][:, :, a:b], v[layer][:, :, a:b], torch.arange(a, b))
    spec.rollback(25)  # 5 of 10 accepted
    assert spec.length == 25 and spec.nbytes() == ref.nbytes()
    for cache in (spec, ref):
        for layer in range(2):
            cache.append(layer, k[layer][:, :, 30:35], v[layer][:, :, 30:35], torch.arange(25, 30))
    assert torch.equal(attend_all(spec, q, 30), attend_all(ref, q, 30))
    with pytest.raises(CompressError, match="at least"):
        spec.rollback(31)


@pytest.mark.parametrize("kind", ["kivi", "packkv"])
def test_rollback_inside_the_window(kind):
    """After a rollback the compressed history is untouched, the window is the old window's head,
    and attention equals a float64 reference over [history; window; new tokens]."""
    torch.manual_seed(0)
    k, v = torch.randn(1, 2, 120, 32), torch.randn(1, 2, 120, 32)
    opts = {"keep_perm": True} if kind == "packkv" else {}  # history() needs the permutation
    cache = make_cache(kind, KVLayout(1, 2, 32), 1, 128, residual=24, **opts)
    cache.append(0, k[:, :, :90], v[:, :, :90])
    cache.append(0, k[:, :, 90:96], v[:, :, 90:96])  # a round of γ + 1 = 6
    hist, window = cache.history(0), cache.win_k[0].clone()
    C = cache.ncomp[0]
    assert C > 0
    cache.rollback(92)  # 1 accepted + the next token
    assert all(torch.equal(a, b) for a, b in zip(cache.history(0), hist))
    assert torch.equal(cache.win_k[0], window[:, :, : 92 - C]) and cache.length == 92
    cache.append(0, k[:, :, 100:103], v[:, :, 100:103])  # slots 92..94
    q = torch.randn(1, 4, 1, 32)
    out = cache.attend(0, q, torch.tensor([94]))
    kh, vh = cache.history(0)
    K, V_ = (
        torch.cat([h, x[:, :, C:92].half(), x[:, :, 100:103].half()], 2).double()
        for h, x in ((kh.half(), k), (vh.half(), v))
    )
    Kr, Vr = K.repeat_interleave(2, 1), V_.repeat_interleave(2, 1)
    ref = torch.softmax(q.double() @ Kr.transpose(-1, -2) / 32**0.5, -1) @ Vr
    assert ((out.double() - ref).norm() / ref.norm()).item() < 1e-3
    with pytest.raises(CompressError, match="residual"):
        cache.rollback(C - 1)


def test_layer_skip_draft_shares_the_target_cache(pair):
    _, target, _, _ = pair
    for L in range(3, 33):  # N layers spread evenly over 1..L-2, centred on the middle
        for N in range(1, L - 1):
            skip = unified_skip(L, N)
            gaps = [b - a for a, b in zip([0] + skip, skip + [L - 1])]
            assert len(set(skip)) == N and 1 <= skip[0] and skip[-1] <= L - 2
            inner = gaps[1:-1] or [0]
            assert max(inner) - min(inner) <= 1 and abs(gaps[0] - gaps[-1]) <= 1
    assert parse_layers("2, 1", 4) == [1, 2]
    for bad in ("0,1,2,3", "7", "a"):
        with pytest.raises(CompressError):
            parse_layers(bad, 4)
    with pytest.raises(CompressError, match="skip"):
        unified_skip(4, 3)
    with pytest.raises(CompressError):
        LayerSkipDraft(target, [])
    a_full, a_skip = agreement(target, PROMPT[0] * 3, []), agreement(target, PROMPT[0] * 3, [1, 2])
    assert a_full == 1.0 and a_skip < 1.0  # no skipped layer: the target, one token at a time


def test_searched_skip_is_saved_once(pair, monkeypatch):
    folder, target, _, _ = pair
    calls = []
    import compress.decoder.speculative.layer_skip as ls

    real = ls.search_skip
    monkeypatch.setattr(ls, "search_skip", lambda *a, **k: calls.append(1) or real(*a, **k))
    ids = list(range(3, 40))
    skip = searched_skip(folder, target, ids, gamma=3)
    assert searched_skip(folder, target, ids, gamma=3) == skip and len(calls) == 1
    saved = json.loads(skip_file(folder).read_text())
    assert saved["gamma=3"]["skip"] == skip and skip_file(folder).parent == folder.parent
    assert all(0 < i < 3 for i in skip)


def test_bandits_run_and_find_the_best_arm():
    """On synthetic arms (acceptance a_r per skip row, 1 + Binomial(γ, a_r) tokens per round), both
    bandits end on the arm of the best tokens per second."""
    gen = torch.Generator().manual_seed(0)
    accept, gammas = [0.3, 0.6, 0.9], [1, 2, 3]
    costs = [[0.8, 1.0, 1.2], [0.9, 1.1, 1.3], [1.0, 1.2, 1.4]]
    arms = [(f"d{r}", gammas[c], costs[r][c]) for r in range(3) for c in range(3)]
    rate = [(1 + gammas[k % 3] * accept[k // 3]) / costs[k // 3][k % 3] for k in range(9)]
    best = max(range(9), key=rate.__getitem__)
    for kind in (Unimodal, UCB1):
        bandit = kind(arms, 3)
        for _ in range(600):
            _, gamma = bandit.next()
            k = bandit.current
            accepted = torch.binomial(
                torch.tensor(float(gamma)), torch.tensor(accept[k // 3]), generator=gen
            )
            bandit.update(gamma, int(accepted), costs[k // 3][k % 3])
        assert bandit.favourite() == best, kind.__name__


def test_bandit_decoding_is_exact(pair):
    _, target, _, _ = pair
    ref = generate(target, PROMPT, 48, ignore_eos=True)
    for kind in ("bandit", "ucb1"):
        bandit = self_bandit(target, kind, skip_counts=[1, 2], gammas=(1, 3))
        r = speculative_generate(target, PROMPT, 48, ignore_eos=True, draft=bandit)
        assert r.tokens == ref.tokens and len(set(bandit.history)) > 1


def test_auto_gamma_is_transformers_heuristic():
    s = AutoGamma("d")
    seen = []
    for gamma_accepted in (5, 3, 0, 0, 0, 0, 0, 0):
        _, g = s.next()
        s.update(g, min(gamma_accepted, g), 0.1)
        seen.append(s.gamma)
    assert seen == [7, 6, 5, 4, 3, 2, 1, 1]
    s.reset()  # each generation starts from 5 again
    assert s.next()[1] == 5


def test_bad_input(pair, tmp_path):
    folder, target, draft_dir, draft = pair
    other = save(tiny_hf(vocab_size=301), tmp_path / "other")
    with pytest.raises(CompressError, match="vocabulary"):
        load_draft(other, target)
    with pytest.raises(CompressError, match="vocabulary"):
        speculative_generate(target, PROMPT, 8, draft=load(other)[0])
    with pytest.raises(CompressError, match="not a model folder"):
        load_draft(tmp_path, target)
    for gamma in (0, -1, 1.5, "many"):
        with pytest.raises(CompressError, match="gamma"):
            speculative_generate(target, PROMPT, 8, draft=draft, gamma=gamma)
    with pytest.raises(CompressError, match="batch 1"):
        speculative_generate(target, PROMPT * 2, 8, draft=draft)
    with pytest.raises(CompressError, match="residual"):
        speculative_generate(
            target, PROMPT, 8, kv="packkv", kv_opts=dict(residual=4), draft=draft, gamma=4
        )
    assert isinstance(Fixed(ModelDraft(draft), 2).next()[0], ModelDraft)


def test_confidence_stops_a_round_early():
    """A round stops after the first draft whose own probability is below the threshold."""
    gen = torch.Generator().manual_seed(0)
    V, gamma = 50, 6
    rows = torch.randn(gamma, V, generator=gen, dtype=torch.float64) * 0.5
    rows[:, 7] += 20.0  # confident rows: token 7 holds nearly all the mass
    rows[2, 7] -= 20.0 - float(torch.log(torch.tensor(0.3 * (V - 1) / 0.7)))  # row 2: p(7) ~ 0.3
    calls = []

    def forward(ids, pos):
        calls.append(pos.tolist())
        return rows[len(calls) - 1].float()[None, None]

    p7 = [float(torch.softmax(r, 0)[r.argmax()]) for r in rows]  # float64 reference
    assert p7[2] < 0.45 and min(p7[:2] + p7[3:]) > 0.99
    for stop_below, n in ((0.0, gamma), (0.2, gamma), (p7[2] + 1e-3, 3)):
        calls.clear()
        tokens, probs = run_drafts(forward, [1, 2], 10, gamma, Sampling(), None, "cpu", stop_below)
        assert len(tokens) == n and probs is None
        assert tokens == [int(r.argmax()) for r in rows[:n]]
        assert calls == [[10, 11]] + [[11 + i] for i in range(1, n)]
    # sampled: the drawn token's probability under the draft's distribution
    probs = torch.softmax(rows[0].float(), 0)
    assert confidence(rows[0].float(), 3, probs) == pytest.approx(float(probs[3]))
    assert confidence(rows[2].float(), 7, None) == pytest.approx(p7[2], rel=1e-5)


def test_confidence_stop_is_exact_and_drafts_less(pair):
    _, target, _, noisy = pair
    ref = generate(target, PROMPT, 64, ignore_eos=True)
    full = speculative_generate(target, PROMPT, 64, ignore_eos=True, draft=noisy, gamma=6)
    short = speculative_generate(
        target, PROMPT, 64, ignore_eos=True, draft=ModelDraft(noisy, stop_below=0.6), gamma=6
    )
    assert short.tokens == full.tokens == ref.tokens
    assert short.drafted < 6 * short.rounds  # some rounds stopped early
    assert short.drafted / short.rounds < full.drafted / full.rounds
    for bad in (1.0, -0.1, True, "0.5"):
        with pytest.raises(CompressError, match="draft confidence"):
            ModelDraft(noisy, stop_below=bad)


def test_other_tokenizer_is_refused(pair, tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    folder, target, _, _ = pair
    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<pad>", "<eos>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tk.train_from_iterator(["an entirely different corpus of words"] * 10, trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<eos>", pad_token="<pad>")
    other = save(tiny_hf(), tmp_path / "other", tok)
    with pytest.raises(CompressError, match="tokenizer"):
        load_draft(other, target, tiny_tokenizer())


def test_cli(pair, capsys):
    folder, _, draft_dir, _ = pair
    base = [
        str(folder),
        "--prompt",
        "the quick brown",
        "--max-new-tokens",
        "24",
        "--json",
        "--no-warmup",
    ]
    cli(base)
    plain = json.loads(capsys.readouterr().out)
    for extra in (
        ["--draft", str(draft_dir), "--gamma", "3"],
        ["--draft", "self", "--skip", "1"],
        ["--draft", "self", "--skip-layers", "1,2", "--gamma", "auto"],
        ["--draft", "self", "--adapt", "bandit"],
        ["--draft", str(draft_dir), "--gamma", "6", "--draft-confidence", "0.5"],
    ):
        cli(base + extra)
        out = json.loads(capsys.readouterr().out)
        assert out["text"] == plain["text"]
        assert 0 <= out["acceptance"] <= 1 and out["tokens_per_pass"] >= 1
    for extra, msg in (
        (["--draft", "self", "--gamma", "0"], "gamma"),
        (["--skip", "2"], "needs --draft"),
        (["--draft", str(draft_dir), "--skip", "1"], "--draft self"),
        (["--draft", "self", "--compile"], "eager forward"),
        (["--draft", str(folder.parent)], "not a model folder"),
        (["--draft-confidence", "0.4"], "needs --draft"),
        (["--draft", "self", "--draft-confidence", "1.5"], "draft confidence"),
    ):
        with pytest.raises(SystemExit):
            cli(base + extra)
        assert msg in capsys.readouterr().err


@pytest.mark.slow
def test_bench_spec_quick(tmp_path, tokenizer):
    """The benchmark end to end on tiny folders with the real tokenizer (chat template): every
    system's row, exact greedy output, and the JSON."""
    hf = make_tiny_model(num_hidden_layers=4)
    for name, model in (("target", hf), ("draft", noisy_copy(hf, 0.01))):
        model.save_pretrained(tmp_path / name)
        tokenizer.save_pretrained(tmp_path / name)
    argv = ["--target", tmp_path / "target", "--drafts", tmp_path / "draft", "--quick"]
    res = run_bench("bench_spec", *argv, "--json", tmp_path / "out.json", timeout=900)
    table = json.loads((tmp_path / "out.json").read_text())["table"]
    names = [t["system"] for t in table]
    assert names[:3] == ["target", "spec:draft", "hf-assisted:draft"]
    assert {"bandit", "ucb1"} <= set(names)
    assert all(t["prompts"] == 2 and t["identical"] + t["ties"] == 2 for t in table)
    assert "speed-up" in res.stdout


@pytest.mark.slow
def test_default_model_self_speculative_is_exact():
    """SmolLM2-135M: greedy self-speculative decoding (unified skip, fixed and auto γ) gives the
    target's own 48 tokens, or diverges only where the target's top-2 logits tie (< 1e-4)."""
    from compress.io.source import convert_default_model

    model, tok = load(convert_default_model())
    ids = tok("The European lobster is a species of clawed lobster from the eastern").input_ids
    ref = generate(model, [ids], 48, ignore_eos=True).tokens[0]
    L = model.config.num_hidden_layers
    for gamma in (4, "auto"):
        draft = LayerSkipDraft(model, unified_skip(L, L // 5))
        r = speculative_generate(model, [ids], 48, ignore_eos=True, draft=draft, gamma=gamma)
        assert r.tokens[0] == ref or first_divergence_is_tie(model, ids, ref, r.tokens[0])
        assert 0 < r.acceptance < 1


@pytest.mark.slow
def test_compiled_draft_is_exact(pair):
    """A draft model decoding with the compiled static step (one token at a time, rolled back by
    position) leaves the output the target's own."""
    _, target, _, noisy = pair
    ref = generate(target, PROMPT, 40, ignore_eos=True)
    r = speculative_generate(
        target, PROMPT, 40, ignore_eos=True, compile=True, draft=ModelDraft(noisy), gamma=3
    )
    assert r.tokens == ref.tokens and 0 < r.accepted < r.drafted
    with pytest.raises(CompressError, match="compile"):
        speculative_generate(target, PROMPT, 8, compile=True, draft=LayerSkipDraft(target, [1]))


def test_eos_and_stop_strings_end_like_plain_decoding(pair):
    folder, target, _, noisy = pair
    tok = tiny_tokenizer()
    ids = tok("the quick brown").input_ids
    plain = generate(target, [ids], 40, tok, ignore_eos=True)
    stop = plain.texts[0][5:8]  # a piece of the continuation: it must cut there
    for kw in (dict(), dict(stop=(stop,))):
        ref = generate(target, [ids], 40, tok, **kw)
        pieces = []
        r = speculative_generate(
            target,
            [ids],
            40,
            tok,
            draft=noisy,
            gamma=4,
            on_text=lambda row, text: pieces.append(text),
            **kw,
        )
        assert r.tokens == ref.tokens and r.texts == ref.texts == ["".join(pieces)]
    assert stop not in r.texts[0] and len(r.tokens[0]) < 40
