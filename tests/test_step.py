"""The one generation step (``compress.decoder.step``): plain generation, speculative decoding
(a draft model, and the target with layers skipped) and the serving engine all run it, every
forward of the target happens inside it, and they give the same greedy tokens; the per-row
sampler draws what each request draws alone."""

import pytest
import torch

from compress.decoder import step as one_step
from compress.decoder.generate import generate
from compress.decoder.sampling import Sampler, Sampling
from compress.decoder.speculative.drafts import LayerSkipDraft
from compress.decoder.speculative.generate import speculative_generate
from compress.serve.engine import Engine
from compress.serve.scheduler import Params
from tests.test_speculative import loaded_pair

N = 24


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    target, draft, tok = loaded_pair(tmp_path_factory.mktemp("step"))
    return target, draft, tok


class Watch:
    """Counts the calls of ``step.step`` and the target's forwards inside and outside of one."""

    def __init__(self, monkeypatch, model):
        self.steps = self.inside = self.outside = self.depth = 0
        real_step, real_forward = one_step.step, model.forward

        def step(*a, **k):
            self.steps, self.depth = self.steps + 1, self.depth + 1
            try:
                return real_step(*a, **k)
            finally:
                self.depth -= 1

        def forward(*a, **k):
            if self.depth:
                self.inside += 1
            else:
                self.outside += 1
            return real_forward(*a, **k)

        monkeypatch.setattr(one_step, "step", step)
        monkeypatch.setattr(model, "forward", forward)

    def take(self) -> tuple[int, int, int]:
        out = self.steps, self.inside, self.outside
        self.steps = self.inside = self.outside = 0
        return out


def prompts_of(tok, n: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(4)
    words = "the quick brown fox jumps over a lazy dog and then sleeps".split()
    return [
        tok(" ".join(words[i % 5 : i % 5 + 2 + int(k)])).input_ids
        for i, k in enumerate(torch.randint(0, 6, (n,), generator=g))
    ]


def test_every_path_runs_the_one_step(models, monkeypatch):
    """Plain generation steps once for the prefill and once per token; speculative decoding once
    for the prefill and once per round, with a draft model and with the target's own layers
    skipped (whose drafting forwards run inside the round's step); the engine once per engine
    step. No forward of the target runs outside a step, and all give the same greedy tokens."""
    target, draft, tok = models
    prompt = prompts_of(tok, 1)[0]
    watch = Watch(monkeypatch, target)

    plain = generate(target, [prompt], N, ignore_eos=True)
    assert len(plain.tokens[0]) == N
    assert watch.take() == (1 + plain.decode_steps, 1 + plain.decode_steps, 0)

    spec = speculative_generate(target, [prompt], N, ignore_eos=True, draft=draft, gamma=4)
    assert spec.tokens == plain.tokens and spec.rounds < N - 1
    assert watch.take() == (1 + spec.rounds, 1 + spec.rounds, 0)

    skip = LayerSkipDraft(target, [1])
    own = speculative_generate(target, [prompt], N, ignore_eos=True, draft=skip, gamma=3)
    assert own.tokens == plain.tokens
    steps, inside, outside = watch.take()
    assert steps == 1 + own.rounds and outside == 0
    assert inside == steps + own.drafted  # every draft token is a layer-skipped forward

    engine = Engine(target, tok, num_blocks=64, block_size=4, max_seqs=4)
    seq = engine.add(prompt, Params(max_tokens=N, ignore_eos=True))
    while engine.has_work():
        engine.step()
    assert seq.output == plain.tokens[0]
    assert watch.take() == (engine.steps, engine.steps, 0)


def test_sixteen_concurrent_requests_equal_each_alone(models):
    """16 greedy requests served together, prompts chunked and preempted, give the tokens of
    ``generate`` (batch 1) on each alone; text too."""
    target, _, tok = models
    prompts = prompts_of(tok, 16)
    engine = Engine(target, tok, num_blocks=24, block_size=4, max_seqs=16, max_step_tokens=16)
    seqs = [engine.add(p, Params(max_tokens=N, ignore_eos=True)) for p in prompts]
    while engine.has_work():
        engine.step()
    for p, s in zip(prompts, seqs):
        alone = generate(target, [p], N, tok, ignore_eos=True)
        assert s.output == alone.tokens[0] and s.stopping.text == alone.texts[0]
    assert engine.stats()["preemptions"] > 0


def test_per_row_sampler_draws_what_each_row_draws_alone():
    """A per-row sampler (the engine's) draws for each row what a one-setting sampler (the
    decoder's) draws for that row alone with the same seed: greedy rows the float64 argmax; a
    row that draws nothing gets -1 and takes nothing from any generator."""
    V = 300
    logits = torch.randn(5, V, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    settings = [
        Sampling(),
        Sampling(temperature=0.8, top_k=20, seed=3),
        None,
        Sampling(temperature=1.2, top_p=0.9, seed=4),
        Sampling(),
    ]
    for dtype in (torch.float32, torch.bfloat16):
        x = logits.to(dtype)
        rows = [None if s is None else (s, Sampler(s).generator) for s in settings]
        per_row = Sampler.per_row(rows)
        draws = [per_row.sample(x).tolist() for _ in range(3)]  # three steps
        for b, s in enumerate(settings):
            if s is None:
                assert [d[b] for d in draws] == [-1] * 3
                continue
            alone = Sampler(s)
            want = [int(alone.sample(x[b : b + 1])[0]) for _ in range(3)]
            assert [d[b] for d in draws] == want, (dtype, b)
            if s.temperature == 0:
                assert want[0] == int(x[b].double().argmax())
        assert not per_row.greedy and Sampler.per_row([rows[0], None]).greedy
