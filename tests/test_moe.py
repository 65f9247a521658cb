"""The mixture-of-experts families (qwen3_moe, qwen2_moe, mixtral, olmoe) against transformers' own
modeling code (eager attention and experts, float32) on tiny random models built from its config
classes and saved with ``save_pretrained`` (per-expert tensors; no download).

Each family has 8 experts, 2 per token, and enough prompt tokens that every expert of every
sparse layer is routed (asserted, with transformers choosing the same experts). The configs
cover: a dense layer among sparse ones (qwen3_moe's ``mlp_only_layers``, qwen2_moe's
``decoder_sparse_step``), renormalized and raw top-k weights (``norm_topk_prob``), qwen2_moe's
sigmoid-gated shared expert, q/k/v biases and a sliding window on one layer, mixtral's
softmax over the top-k with a 16-token window on every layer, and olmoe's q/k norms over the
whole projections. The logits are held to ``TOL`` with the exact caches (eager, batch 1 and
left-padded, the paged engine and, marked slow, the compiled step) and ``FP16_TOL`` with the fp16
ones, as in ``tests/test_family_exactness.py``, over a prompt longer than the window plus 64
greedy steps.

Routing is discrete: where transformers' router nearly ties its k-th and (k+1)-th expert
(probabilities within ``MARGIN``), the fp16 caches' rounding of K and V (about 2^-11) may pick
the other expert, and that position's logits then differ by far more than the rounding. The
fp16 checks leave such positions out (at most a fraction ``MAX_TIES`` of them); the exact caches
compare every position.
"""

import copy
import shutil
from dataclasses import replace

import pytest
import torch
import transformers as tf
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from compress.arch import adapters
from compress.arch.spec import spec_of
from compress.decoder.experts import Experts, Router, SparseMoE
from compress.decoder.kv import new_cache
from compress.decoder.model import FeedForward, Transformer, load
from compress.errors import CompressError
from tests.test_arch_spec import write_config
from tests.test_family_exactness import (
    COMMON,
    FP16_TOL,
    STEPS,
    TOL,
    WINDOW,
    check_engine,
    check_rows,
    ours_greedy,
    prompts,
    rel,
)

E, K, EXPERT = 8, 2, 32
MARGIN, MAX_TIES = 1e-3, 0.1
FAMILIES = ["qwen3_moe", "qwen2_moe", "mixtral", "olmoe"]
# (n_experts, top_k, router, norm_topk, expert width, shared width, each layer's MLP)
EXPECTED = {
    "qwen3_moe": (E, K, "softmax_topk", True, EXPERT, None, ["experts", "dense", "experts"]),
    "qwen2_moe": (E, K, "softmax_topk", False, EXPERT, 48, ["dense", "experts"] * 2),
    "mixtral": (E, K, "topk_softmax", True, EXPERT, None, ["experts"] * 2),
    "olmoe": (E, K, "softmax_topk", False, EXPERT, None, ["experts"] * 2),
}


def moe_config(family: str, **over):
    kw = dict(COMMON, num_experts_per_tok=K)
    if family == "qwen3_moe":
        kw.update(num_hidden_layers=3, num_experts=E, moe_intermediate_size=EXPERT)
        kw.update(norm_topk_prob=True, mlp_only_layers=[1])
        return tf.Qwen3MoeConfig(**dict(kw, **over))
    if family == "qwen2_moe":
        kw.update(num_hidden_layers=4, num_experts=E, moe_intermediate_size=EXPERT)
        kw.update(shared_expert_intermediate_size=48, decoder_sparse_step=2)
        kw.update(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1)
        return tf.Qwen2MoeConfig(**dict(kw, **over))
    if family == "mixtral":
        kw.update(num_hidden_layers=2, num_local_experts=E, intermediate_size=EXPERT)
        return tf.MixtralConfig(**dict(kw, sliding_window=WINDOW, **over))
    if family == "olmoe":
        kw.update(num_hidden_layers=2, num_experts=E, intermediate_size=EXPERT)
        return tf.OlmoeConfig(**dict(kw, **over))
    raise AssertionError(family)


def hf_model(config):
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # norms away from their init
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.3)
    return hf


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, tmp_path_factory):
    """(name, ours, transformers' model, folder), both models loaded from one saved folder."""
    folder = tmp_path_factory.mktemp(request.param)
    hf_model(moe_config(request.param)).save_pretrained(folder)
    ref = AutoModelForCausalLM.from_pretrained(
        folder, attn_implementation="eager", experts_implementation="eager", dtype=torch.float32
    ).eval()
    ours, _ = load(folder)
    return request.param, ours, ref, folder


def routers(model) -> list:
    return [m for m in model.modules() if isinstance(m, Router)]


@torch.no_grad()
def routed(model, ids, cache=None) -> tuple[list[torch.Tensor], torch.Tensor]:
    """``(each sparse layer's chosen experts [N, k], logits)`` of one forward of ``ids``."""
    seen = []
    hooks = [r.register_forward_hook(lambda m, i, o: seen.append(o[1])) for r in routers(model)]
    try:
        cache = cache if cache is not None else new_cache(model, "full", 1, ids.shape[1])
        out = model(ids, cache)
    finally:
        for h in hooks:
            h.remove()
    return seen, out


def test_every_expert_routed_as_transformers_routes(family):
    """The prompt routes every expert of every sparse layer, each token to the experts
    transformers' router picks."""
    name, ours, ref, _ = family
    ids = torch.tensor(prompts(1))
    ours_e, _ = routed(ours, ids)
    theirs = []
    hooks = [
        m.register_forward_hook(lambda m, i, o: theirs.append(o[2]))
        for n, m in ref.named_modules()
        if n.endswith("mlp.gate")
    ]
    with torch.no_grad():
        ref(ids)
    for h in hooks:
        h.remove()
    assert len(ours_e) == len(theirs) == EXPECTED[name][-1].count("experts")
    for mine, want in zip(ours_e, theirs):
        assert set(mine.flatten().tolist()) == set(range(E))
        assert torch.equal(mine.sort(-1).values, want.sort(-1).values)


@pytest.mark.parametrize("batch", [1, 2])
def test_eager_full_cache_matches_transformers(family, batch):
    name, ours, ref, _ = family
    tokens, logits, start = ours_greedy(ours, prompts(batch))
    assert tokens.shape[1] - (0 if start is None else int(start.max())) > WINDOW + STEPS
    check_rows(ref, tokens, logits, start, TOL)


def untied(ref):
    """``reference(tokens [1, T]) -> (logits [T, V], keep [T])``: transformers' logits, and the
    positions where no sparse layer's router nearly ties (top-k boundary gap >= MARGIN)."""

    def reference(tokens):
        seen = []
        hooks = [
            m.register_forward_hook(lambda m, i, o: seen.append(o[0]))
            for n, m in ref.named_modules()
            if n.endswith("mlp.gate")
        ]
        try:
            with torch.no_grad():
                logits = ref(tokens).logits[0]
        finally:
            for h in hooks:
                h.remove()
        p = torch.stack([torch.softmax(x.float(), -1) for x in seen]).sort(-1, descending=True)[0]
        keep = (p[..., K - 1] - p[..., K]).min(0).values >= MARGIN
        assert (~keep).float().mean() <= MAX_TIES
        return logits, keep

    return reference


@pytest.mark.parametrize("batch", [1, 2])
def test_eager_fp16_cache_matches_transformers(family, batch):
    """fp16 K/V: every position whose routing is not a near tie within FP16_TOL."""
    name, ours, ref, _ = family
    tokens, logits, start = ours_greedy(ours, prompts(batch), kv="fp16")
    reference = untied(ref)
    for b in range(tokens.shape[0]):
        s = 0 if start is None else int(start[b])
        want, keep = reference(tokens[b : b + 1, s:])
        assert rel(logits[b, s:][keep], want[keep]) < FP16_TOL


@pytest.mark.slow
def test_compiled_step_matches_transformers(family):
    """The compiled static decode step (``compress.decoder.compiled``), the experts run outside
    its graph: every step ran compiled, batch 1, full cache."""
    name, ours, ref, _ = family
    steps = ours.__dict__.get("static_steps", {})
    before = steps[1].compiled_calls if 1 in steps else 0
    tokens, logits, start = ours_greedy(ours, prompts(1), compiled=True)
    assert ours.static_steps[1].compiled_calls - before == STEPS
    check_rows(ref, tokens, logits, start, TOL)


@pytest.mark.parametrize("kv", ["full", "fp16"])
def test_paged_engine_matches_transformers(family, kv):
    name, ours, ref, _ = family
    check_engine(ours, ref, kv, None if kv == "full" else untied(ref))


@torch.no_grad()
def test_decode_reads_only_routed_experts(family):
    """A batch-1 decode step after the prompt: with every expert it does not route to set to NaN
    (gate_up and down), its logits stay finite and equal."""
    name, ours, ref, _ = family
    ids = torch.tensor(prompts(1))
    cache = new_cache(ours, "full", 1, ids.shape[1] + 1)
    ours(ids, cache)
    step = ids[:, -1:]
    chosen, want = routed(ours, step, copy.deepcopy(cache))
    experts = [m for m in ours.modules() if isinstance(m, Experts)]
    saved = [(m.gate_up_proj.clone(), m.down_proj.clone()) for m in experts]
    try:
        for m, e in zip(experts, chosen):
            idle = sorted(set(range(E)) - set(e.flatten().tolist()))
            assert len(idle) == E - K
            m.gate_up_proj[idle] = float("nan")
            m.down_proj[idle] = float("nan")
        _, got = routed(ours, step, copy.deepcopy(cache))
    finally:
        for m, (gu, d) in zip(experts, saved):
            m.gate_up_proj.copy_(gu)
            m.down_proj.copy_(d)
    assert torch.isfinite(got).all() and torch.equal(got, want)


@pytest.mark.parametrize("name", FAMILIES)
def test_spec_moe_fields_agree_with_transformers(name):
    """The spec's experts against transformers' modules of the same config."""
    config = moe_config(name)
    spec = spec_of(config)
    n, k, router, renorm, width, shared, kinds = EXPECTED[name]
    m = spec.moe
    assert (m.n_experts, m.top_k, m.router, m.norm_topk) == (n, k, router, renorm)
    assert (m.intermediate_size, m.shared_intermediate_size) == (width, shared)
    assert [ls.mlp for ls in spec.layers] == kinds
    assert spec.qk_norm_full == (name == "olmoe")
    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(config)
        ours = Transformer(config)
    for ls, layer, block in zip(spec.layers, hf.model.layers, ours.model.layers):
        mlp = layer.mlp
        assert hasattr(mlp, "experts") == (ls.mlp == "experts")
        if ls.mlp == "dense":
            assert isinstance(block.mlp, FeedForward)
            assert block.mlp.down_proj.weight.shape == mlp.down_proj.weight.shape
            continue
        assert isinstance(block.mlp, SparseMoE)
        assert mlp.gate.top_k == m.top_k and mlp.gate.weight.shape == (n, spec.hidden_size)
        for t in ("gate_up_proj", "down_proj"):
            assert getattr(block.mlp.experts, t).shape == getattr(mlp.experts, t).shape
        assert hasattr(mlp, "shared_expert") == (shared is not None)
        if shared:
            assert mlp.shared_expert.up_proj.out_features == shared
        attn, mine = layer.self_attn, block.self_attn
        if spec.qk_norm:
            assert mine.q_norm.weight.shape == attn.q_norm.weight.shape
            assert mine.k_norm.weight.shape == attn.k_norm.weight.shape
        assert ls.window == (WINDOW if ls.kind == "sliding_attention" else None)
    assert [ls.window for ls in spec.layers] == {
        "qwen3_moe": [None] * 3,
        "qwen2_moe": [WINDOW, None, None, None],
        "mixtral": [WINDOW] * 2,
        "olmoe": [None] * 2,
    }[name]


def test_fused_checkpoint_loads_the_same(family, tmp_path):
    """A checkpoint holding the experts fused (transformers' in-memory names) loads to the same
    model as ``save_pretrained``'s per-expert one."""
    name, ours, ref, folder = family
    fused = tmp_path / "fused"
    fused.mkdir()
    shutil.copy(folder / "config.json", fused / "config.json")
    state = {k: v.contiguous() for k, v in ref.state_dict().items()}
    assert any(k.endswith("mlp.experts.gate_up_proj") for k in state)
    save_file(state, str(fused / "model.safetensors"))
    again, _ = load(fused)
    ids = torch.tensor(prompts(1))
    with torch.no_grad():
        a = ours(ids, new_cache(ours, "full", 1, ids.shape[1]))
        b = again(ids, new_cache(again, "full", 1, ids.shape[1]))
    assert torch.equal(a, b)


def test_missing_expert_tensor_is_named(family, tmp_path):
    name, _, ref, folder = family
    part = tmp_path / "part"
    part.mkdir()
    shutil.copy(folder / "config.json", part / "config.json")
    state = load_file(str(folder / "model.safetensors"))
    gone = next(k for k in state if ".experts.3." in k)
    del state[gone]
    save_file(state, str(part / "model.safetensors"))
    with pytest.raises(CompressError, match="lacks") as e:
        load(part)
    assert gone in str(e.value)


@pytest.mark.parametrize(
    "name, raw, match",
    [
        ("qwen3_moe", {"num_experts_per_tok": 9}, "num_experts_per_tok=9 of 8"),
        ("mixtral", {"num_experts_per_tok": 0}, "num_experts_per_tok=0 of 8"),
        ("olmoe", {"num_experts": 0}, "num_experts=0"),
        ("qwen3_moe", {"moe_intermediate_size": 0}, "moe_intermediate_size=0"),
        ("qwen2_moe", {"shared_expert_intermediate_size": 0}, "shared_expert_intermediate"),
        ("qwen2_moe", {"decoder_sparse_step": 0}, "decoder_sparse_step=0"),
        ("qwen3_moe", {"mlp_only_layers": [5]}, r"mlp_only_layers \[5\]"),
        ("olmoe", {"clip_qkv": 8.0}, "clip_qkv=8.0"),
        ("olmoe", {"sliding_window": 16}, "sliding_window=16"),
    ],
)
def test_refused_before_loading_weights(tmp_path, name, raw, match):
    folder = write_config(tmp_path / "m", moe_config(name), **raw)
    with pytest.raises(CompressError, match=match) as e:
        load(folder)
    assert "safetensors" not in str(e.value)


def test_unknown_router_kind_refused(monkeypatch):
    """A family entry whose router the decoder does not compute is refused, naming the fix."""
    entry = replace(adapters.ADAPTERS["mixtral"], router="sigmoid_topk")
    monkeypatch.setitem(adapters.ADAPTERS, "mixtral", entry)
    with pytest.raises(CompressError, match="router kind 'sigmoid_topk'.*Adapter.router"):
        spec_of(moe_config("mixtral"))


def test_gathered_and_grouped_experts_agree(family):
    """The two ways of running the routed experts (rows through their own gathered experts, and
    each expert over its rows) give the same output on a prompt's rows."""
    name, ours, _, _ = family
    block = next(b for b in ours.model.layers if isinstance(b.mlp, SparseMoE))
    x = torch.randn(24, ours.spec.hidden_size, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        w, e = block.mlp.gate(x)
        a = block.mlp.experts.gathered(x, w, e)
        b = block.mlp.experts.grouped(x, w, e)
    assert set(e.flatten().tolist()) == set(range(E))
    assert rel(a, b) < 1e-6


@pytest.mark.parametrize("recipe", ["rtn_int4", "awq_int4", "gptq_int4", "minitron_width", "gqa"])
def test_methods_refuse_experts_before_loading(family, recipe):
    """Until the methods reach the experts, a method recipe on an MoE folder is refused in
    ``validate`` (milliseconds, before any weight is read), naming the family; ``fp`` runs."""
    from compress.recipe.config import compose, validate

    name, _, _, folder = family
    over = [f"model.path={folder}", "eval.seqlen=256"]
    cfg = compose(recipe, over)
    with pytest.raises(CompressError, match="mixture-of-experts model: the methods do not"):
        validate(cfg)
    validate(compose("fp", over))
