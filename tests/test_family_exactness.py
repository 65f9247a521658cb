"""Every supported family's logits against transformers' own modeling code (eager attention,
float32), on tiny random models built from transformers' config classes and saved with
``save_pretrained`` (no download): llama with llama3 RoPE scaling, mistral with a 16-token
sliding window, qwen2 (q/k/v biases, sliding window on its upper layers), qwen3 (q/k norms) and
gemma3_text (16-token window on three of four layers, local/global RoPE, four (1 + w) norms,
GELU-tanh, scaled embeddings, query_pre_attn_scalar, final softcap).

Each run is a prompt longer than the window plus 64 greedy steps, compared position by position
with transformers' forward over the same tokens (row by row, each alone, for left-padded
batches): ``||ours - ref|| / ||ref|| < 1e-4`` with the exact caches (``full``, the paged ``full``).
The fp16 caches round K and V to float16 (relative error about 2^-11 per entry), so they are
held to ``FP16_TOL`` against transformers instead.
"""

import pytest
import torch

from compress.decoder.generate import left_pad, static_step
from compress.decoder.kv import new_cache
from compress.decoder.model import load
from compress.serve.engine import Engine
from compress.serve.scheduler import Params
from compress.testing import SIZES, TOKENS

TOL, FP16_TOL = 1e-4, 3e-3
STEPS, WINDOW = 64, 16
PROMPTS = [40, 27]  # longer than the window; the second row left-padded by 13 in a batch

COMMON = dict(SIZES, **TOKENS, vocab_size=300, head_dim=16, max_position_embeddings=512)
COMMON.update(initializer_range=0.2, tie_word_embeddings=False, eos_token_id=None)


def family_config(family: str):
    import transformers as tf

    if family == "llama":
        rope = dict(
            rope_type="llama3",
            rope_theta=10000.0,
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=32,
        )
        return tf.LlamaConfig(**COMMON, num_hidden_layers=2, rope_parameters=rope)
    if family == "mistral":
        return tf.MistralConfig(**COMMON, num_hidden_layers=2, sliding_window=WINDOW)
    if family == "qwen2":
        return tf.Qwen2Config(
            **COMMON,
            num_hidden_layers=3,
            use_sliding_window=True,
            sliding_window=WINDOW,
            max_window_layers=1,
        )
    if family == "qwen3":
        return tf.Qwen3Config(**COMMON, num_hidden_layers=2)
    if family == "gemma3_text":
        kw = dict(COMMON, tie_word_embeddings=True)
        rope = {
            "sliding_attention": dict(rope_type="default", rope_theta=10000.0),
            "full_attention": dict(rope_type="linear", rope_theta=1e6, factor=4.0),
        }
        return tf.Gemma3TextConfig(
            **kw,
            num_hidden_layers=4,
            sliding_window=WINDOW,
            layer_types=["sliding_attention", "sliding_attention", "full_attention"]
            + ["sliding_attention"],
            rope_parameters=rope,
            query_pre_attn_scalar=24,
            final_logit_softcapping=30.0,
        )
    raise AssertionError(family)


FAMILIES = ["llama", "mistral", "qwen2", "qwen3", "gemma3_text"]


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, tmp_path_factory):
    """(ours, transformers' model) of one family, both loaded from one saved folder."""
    from transformers import AutoModelForCausalLM

    config = family_config(request.param)
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # norms away from their init, so (1 + w) against w shows
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.3)
    folder = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(folder)
    ref = AutoModelForCausalLM.from_pretrained(
        folder, attn_implementation="eager", dtype=torch.float32
    ).eval()
    ours, _ = load(folder)
    return request.param, ours, ref


def prompts(batch: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(1, 300, (n,), generator=g).tolist() for n in PROMPTS[:batch]]


@torch.no_grad()
def ours_greedy(model, rows, kv="full", compiled=False):
    """``(tokens [B, T0 + STEPS], logits [B, T0 + STEPS, V])``: the prompt's logits, then STEPS
    greedy steps, each row left-padded to the longest."""
    ids, start = left_pad(rows, 0, "cpu")
    B, T0 = ids.shape
    if compiled:
        step, cache = static_step(model, kv, None, B, T0 + STEPS)
    else:
        step, cache = model, new_cache(model, kv, B, T0 + STEPS)
    out = [model(ids, cache, start=start)]
    toks = [ids]
    for _ in range(STEPS):
        x = out[-1][:, -1].argmax(-1)[:, None]
        toks.append(x)
        out.append(step(x, cache, start=start))
    return torch.cat(toks, 1), torch.cat(out, 1), start


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@torch.no_grad()
def check_rows(ref, tokens, logits, start, tol):
    """Each row's logits against transformers' forward over that row's own tokens alone."""
    errs = []
    for b in range(tokens.shape[0]):
        s = 0 if start is None else int(start[b])
        want = ref(tokens[b : b + 1, s:]).logits[0]
        errs.append(rel(logits[b, s:], want))
    assert max(errs) < tol, errs
    return errs


@pytest.mark.parametrize("batch", [1, 2])
def test_eager_full_cache_matches_transformers(family, batch):
    name, ours, ref = family
    tokens, logits, start = ours_greedy(ours, prompts(batch))
    assert tokens.shape[1] - (0 if start is None else int(start.max())) > WINDOW + STEPS
    check_rows(ref, tokens, logits, start, TOL)


@pytest.mark.parametrize("batch", [1, 2])
def test_eager_fp16_cache_matches_transformers(family, batch):
    """fp16 K/V: against transformers within FP16_TOL, and the window's ring bounds its bytes."""
    name, ours, ref = family
    tokens, logits, start = ours_greedy(ours, prompts(batch), kv="fp16")
    check_rows(ref, tokens, logits, start, FP16_TOL)


@pytest.mark.slow
@pytest.mark.parametrize("batch", [1, 2])
def test_compiled_step_matches_transformers(family, batch):
    """The compiled static decode step (``compress.decoder.compiled``) over the full cache; its
    compiled graph ran every step (not the eager fallback, which computes the same)."""
    name, ours, ref = family
    steps = ours.__dict__.get("static_steps", {})
    before = steps[batch].compiled_calls if batch in steps else 0
    tokens, logits, start = ours_greedy(ours, prompts(batch), compiled=True)
    assert ours.static_steps[batch].compiled_calls - before == STEPS
    check_rows(ref, tokens, logits, start, TOL)


@pytest.mark.parametrize("kv", ["full", "fp16"])
def test_paged_engine_matches_transformers(family, kv):
    """Continuous batching over the paged cache: two requests, 64 greedy tokens each; every
    sampled position's logits against transformers over the request's tokens."""
    name, ours, ref = family
    check_engine(ours, ref, kv)


def whole(ref):
    """``ref``'s logits at every position, all kept (see :func:`check_engine`)."""

    def reference(tokens):
        logits = ref(tokens).logits[0]
        return logits, torch.ones(logits.shape[0], dtype=torch.bool)

    return reference


def check_engine(ours, ref, kv, reference=None):
    """Two requests of :func:`prompts` through the paged engine (``kv`` "full" or "fp16"), 64
    greedy tokens each, every sampled position's logits against ``ref`` (transformers).
    ``reference(tokens [1, T]) -> (logits [T, V], keep [T] bool)``, if given, replaces ``ref``'s
    forward and leaves out the positions not kept."""
    engine = Engine(ours, num_blocks=32, block_size=8, max_seqs=2, kv=kv)
    seqs = [engine.add(p, Params(max_tokens=STEPS, ignore_eos=True)) for p in prompts(2)]
    seen = {s.id: {} for s in seqs}  # position -> logits predicting the token after it
    layout, model, steps = engine.layout, engine.model, []

    def record_layout(batch):
        steps.append([(s, s.computed + n - 1) for s, n in batch])  # each row's last position
        return layout(batch)

    def record_model(*a, **k):
        out = model(*a, **k)
        for b, (s, at) in enumerate(steps[-1]):
            seen[s.id][at] = out[b, -1]
        return out

    engine.layout, engine.model = record_layout, record_model
    while engine.has_work():
        engine.step()
    tol = TOL if kv == "full" else FP16_TOL
    for s in seqs:
        tokens = torch.tensor([s.tokens])
        assert len(s.output) == STEPS
        with torch.no_grad():
            want, keep = (reference or whole(ref))(tokens[:, :-1])
        at = sorted(p for p in seen[s.id] if p >= s.n_prompt - 1)
        assert len(at) == STEPS
        at = [p for p in at if keep[p]]
        got = torch.stack([seen[s.id][p] for p in at])
        assert rel(got, want[at]) < tol
