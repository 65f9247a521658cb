"""The mixture-of-experts families (qwen3_moe, qwen2_moe, mixtral, olmoe, deepseek_v3, gpt_oss) against transformers' own
modeling code (eager attention and experts, float32) on tiny random models built from its config
classes and saved with ``save_pretrained`` (per-expert tensors; no download).

Each family has 8 experts, 2 per token, and enough prompt tokens that every expert of every
sparse layer is routed (asserted, with transformers choosing the same experts). The configs
cover: a dense layer among sparse ones (qwen3_moe's ``mlp_only_layers``, qwen2_moe's
``decoder_sparse_step``), renormalized and raw top-k weights (``norm_topk_prob``), qwen2_moe's
sigmoid-gated shared expert, q/k/v biases and a sliding window on one layer, mixtral's
softmax over the top-k with a 16-token window on every layer, and olmoe's q/k norms over the
whole projections, and deepseek_v3 twice: with ``q_lora_rank`` and interleaved RoPE, and
without ``q_lora_rank`` with YaRN (a context beyond ``original_max_position_embeddings``),
half-split RoPE and attention biases; both with a dense first layer, shared experts, a random correction bias and
a group-limited sigmoid router with ``routed_scaling_factor``; and gpt_oss: attention sinks (random,
large enough to matter), q/k/v/o biases, a sliding layer then a full one, YaRN without
truncation, the biased router and the transposed experts with random biases and the clamped
SwiGLU (a limit the gates cross). The logits are held to ``TOL`` with the exact caches (eager, batch 1 and
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
import json
import shutil
from dataclasses import replace

import pytest
import torch
import transformers as tf
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from compress.arch import adapters
from compress.arch.spec import spec_of
from compress.decoder.experts import Experts, QuantExperts, Router, SparseMoE
from compress.decoder.kv import new_cache
from compress.decoder.model import FeedForward, Transformer, load
from compress.errors import CompressError
from compress.layers import QuantLinear
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
FAMILIES = [
    "qwen3_moe",
    "qwen2_moe",
    "mixtral",
    "olmoe",
    "deepseek_v3",
    "deepseek_v3_yarn",
    "gpt_oss",
]
QUANT_FAMILIES = [f for f in FAMILIES if f != "gpt_oss"]  # gpt_oss's experts: refused (a test)
METHODS = ("rtn", "awq", "gptq")  # the quantizers that reach every expert
# (n_experts, top_k, router, norm_topk, expert width, shared width, each layer's MLP)
EXPECTED = {
    "qwen3_moe": (E, K, "softmax_topk", True, EXPERT, None, ["experts", "dense", "experts"]),
    "qwen2_moe": (E, K, "softmax_topk", False, EXPERT, 48, ["dense", "experts"] * 2),
    "mixtral": (E, K, "topk_softmax", True, EXPERT, None, ["experts"] * 2),
    "olmoe": (E, K, "softmax_topk", False, EXPERT, None, ["experts"] * 2),
    "deepseek_v3": (E, K, "sigmoid_group", True, EXPERT, EXPERT, ["dense", "experts", "experts"]),
    "deepseek_v3_yarn": (
        E,
        K,
        "sigmoid_group",
        True,
        EXPERT,
        2 * EXPERT,
        ["dense"] + ["experts"] * 2,
    ),
    "gpt_oss": (E, K, "biased_topk_softmax", True, EXPERT, None, ["experts"] * 2),
}
YARN = dict(
    rope_type="yarn",
    rope_theta=10000.0,
    factor=4.0,
    original_max_position_embeddings=32,  # the tests run past it
    mscale=1.0,
    mscale_all_dim=0.8,
    beta_fast=32,
    beta_slow=1,
)


SWIGLU_LIMIT = 1.0  # gpt_oss: low enough that the tiny model's gates and ups cross it


def deepseek_config(**over):
    """A tiny DeepSeek V3: 4 groups of 2 experts, the 2 best groups eligible."""
    kw = dict(COMMON, num_hidden_layers=3, num_experts_per_tok=K, n_routed_experts=E)
    del kw["head_dim"]  # deepseek_v3's head_dim is qk_rope_head_dim
    kw.update(num_key_value_heads=COMMON["num_attention_heads"], moe_intermediate_size=EXPERT)
    kw.update(n_shared_experts=1, first_k_dense_replace=1, n_group=4, topk_group=2)
    kw.update(routed_scaling_factor=2.5, norm_topk_prob=True, kv_lora_rank=24)
    kw.update(q_lora_rank=40, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=12)
    return tf.DeepseekV3Config(**dict(kw, **over))


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
    if family == "deepseek_v3":
        return deepseek_config(**over)
    if family == "deepseek_v3_yarn":
        kw = dict(q_lora_rank=None, rope_interleave=False, rope_parameters=YARN, n_shared_experts=2)
        kw.update(attention_bias=True)  # kv_a_proj_with_mqa's and o_proj's biases
        return deepseek_config(**dict(kw, **over))
    if family == "gpt_oss":
        kw.update(num_hidden_layers=2, num_local_experts=E, intermediate_size=EXPERT)
        kw.update(sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"])
        yarn = dict(YARN, factor=16.0, truncate=False)  # 512 / 32 positions
        del yarn["mscale"], yarn["mscale_all_dim"]
        kw.update(attention_bias=True, rope_parameters=yarn, swiglu_limit=SWIGLU_LIMIT)
        return tf.GptOssConfig(**dict(kw, **over))
    raise AssertionError(family)


def hf_model(config):
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # norms and biases away from their init, DeepSeek's correction bias too
        for name, p in hf.named_parameters():
            if "norm" in name or name.endswith((".bias", "_bias")):  # biases away from zero too
                p.add_(torch.randn_like(p) * 0.3)
            if name.endswith("sinks"):  # gpt_oss: sink logits as large as the scores
                p.copy_(torch.randn_like(p) * 2)
        for name, b in hf.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn_like(b) * 0.05)
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


ROUTER_NAMES = ("mlp.gate", "mlp.router")  # transformers' router modules (gpt_oss: router)


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
        if n.endswith(ROUTER_NAMES)
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


def boundary_gap(gate, logits: torch.Tensor) -> torch.Tensor:
    """``[N]``: how far each row's routing is from changing: the gap between the k-th and
    (k+1)-th eligible expert, and for DeepSeek's grouped router also between the last chosen
    group and the next (its scores with the correction bias, as its router chooses)."""
    if not hasattr(gate, "e_score_correction_bias"):
        p = torch.softmax(logits.float(), -1).sort(-1, descending=True)[0]
        return p[:, K - 1] - p[:, K]
    c = logits.float().sigmoid() + gate.e_score_correction_bias
    group = c.unflatten(-1, (gate.num_group, -1)).topk(2, -1)[0].sum(-1)
    g = group.sort(-1, descending=True)[0]
    chosen = group.topk(gate.topk_group, -1)[1]
    keep = torch.zeros_like(group).scatter_(1, chosen, 1).bool()
    c = c.masked_fill(~keep.repeat_interleave(E // gate.num_group, -1), float("-inf"))
    p = c.sort(-1, descending=True)[0]
    return torch.minimum(g[:, gate.topk_group - 1] - g[:, gate.topk_group], p[:, K - 1] - p[:, K])


def untied(ref):
    """``reference(tokens [1, T]) -> (logits [T, V], keep [T])``: transformers' logits, and the
    positions where no sparse layer's router nearly ties (:func:`boundary_gap` >= MARGIN)."""

    def reference(tokens):
        seen = []
        hooks = [
            m.register_forward_hook(lambda m, i, o: seen.append(boundary_gap(m, o[0])))
            for n, m in ref.named_modules()
            if n.endswith(ROUTER_NAMES)
        ]
        try:
            with torch.no_grad():
                logits = ref(tokens).logits[0]
        finally:
            for h in hooks:
                h.remove()
        keep = torch.stack(seen).min(0).values >= MARGIN
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
        gate = mlp.router if name == "gpt_oss" else mlp.gate
        assert gate.top_k == m.top_k and gate.weight.shape == (n, spec.hidden_size)
        assert (block.mlp.gate.bias is not None) == (name == "gpt_oss") == hasattr(gate, "bias")
        for t in ("gate_up_proj", "down_proj"):
            theirs = getattr(mlp.experts, t)  # gpt_oss: [E, H, 2I] and [E, I, H]
            theirs = theirs.transpose(1, 2) if name == "gpt_oss" else theirs
            assert getattr(block.mlp.experts, t).shape == theirs.shape
        shared_name = "shared_experts" if name.startswith("deepseek") else "shared_expert"
        assert hasattr(mlp, shared_name) == (shared is not None)
        if shared:
            assert getattr(mlp, shared_name).up_proj.out_features == shared
            assert getattr(block.mlp, shared_name).up_proj.out_features == shared
            assert hasattr(mlp, "shared_expert_gate") == block.mlp.gated
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
        "deepseek_v3": [None] * 3,
        "deepseek_v3_yarn": [None] * 3,
        "gpt_oss": [WINDOW, None],
    }[name]
    sinks = [getattr(b.self_attn, "sinks", None) for b in ours.model.layers]
    assert all((s is not None) == (name == "gpt_oss") for s in sinks)


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
    """An expert tensor missing from the checkpoint (gpt_oss, stored fused: a layer's expert
    biases) is named in the error."""
    name, _, ref, folder = family
    part = tmp_path / "part"
    part.mkdir()
    shutil.copy(folder / "config.json", part / "config.json")
    state = load_file(str(folder / "model.safetensors"))
    gone = next(k for k in state if ".experts.3." in k or k.endswith("experts.down_proj_bias"))
    del state[gone]
    save_file(state, str(part / "model.safetensors"))
    with pytest.raises(CompressError, match="lacks|missing") as e:
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
        ("deepseek_v3", {"n_group": 3}, "8 experts into n_group=3"),
        ("deepseek_v3", {"topk_group": 5}, "topk_group=5 of 4"),
        ("deepseek_v3", {"topk_group": 1, "num_experts_per_tok": 3}, "3 experts among topk_g"),
        ("deepseek_v3", {"first_k_dense_replace": 4}, "first_k_dense_replace=4"),
        ("deepseek_v3", {"kv_lora_rank": 0}, "kv_lora_rank=0"),
        ("deepseek_v3", {"qk_rope_head_dim": 7}, "odd qk_rope_head_dim=7"),
        ("deepseek_v3", {"routed_scaling_factor": -1.0}, "routed_scaling_factor=-1.0"),
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


@pytest.mark.parametrize(
    "recipe, extra, match",
    [
        ("awq_int4", [], "awq.symmetric=false on"),
        ("awq_gptq_int4", [], "awq.symmetric=false on"),
        ("awq_int4", ["awq.symmetric=true", "awq.experts=some"], "awq.experts='some'"),
        ("gptq_int4", [], "gptq.symmetric=false on"),
        ("minitron_width", [], "prune cannot run there"),
        ("gqa", [], "gqa cannot run there"),
        ("llm_int8", [], "llm_int8 cannot run there .bitsandbytes"),
        ("rtn_int4", [], "rtn.symmetric=false on"),
        ("rtn_int8", ["rtn.symmetric=true", "rtn.group_size=16"], "shared_expert.gate_proj"),
        ("rtn_int4", ["rtn.symmetric=true", "quant.format=autoawq"], "quant.format=autoawq on"),
    ],
)
def test_methods_that_miss_experts_are_refused_before_loading(family, recipe, extra, match):
    """A method that does not reach every expert, or an RTN scheme transformers cannot load for
    experts, is refused in ``validate`` (milliseconds, before any weight is read), naming the
    reason; ``fp`` and symmetric ``rtn`` pass."""
    from compress.recipe.config import validate
    from compress.recipe.overrides import compose

    name, _, _, folder = family
    over = [f"model.path={folder}", "eval.seqlen=256"]
    given = " ".join(extra)
    if name == "gpt_oss" and "symmetric=true" in given and "quant.format" not in given:
        match = "gpt_oss's experts"  # its own refusal (test_gpt_oss_quantization_refused)
    if name == "qwen2_moe" and "awq.symmetric=true" in extra:
        pytest.skip("its 48-wide shared expert fails the auto group size check first")
    if "shared_expert" in match and name not in ("qwen2_moe", "gpt_oss"):  # 48 wide
        validate(compose(recipe, over + extra))
        return
    with pytest.raises(CompressError, match=match):
        validate(compose(recipe, over + extra))
    validate(compose("fp", over))


class _Runs(dict):
    """``runs[family, method]``: (source folder, run folder, report), each family's three runs
    made on first use, so a test of one family pays for that family's alone."""

    def __init__(self, root, tokenizer):
        super().__init__()
        self.root, self.tokenizer = root, tokenizer

    def __missing__(self, key):
        from compress.recipe.pipeline import run
        from tests.conftest import compose

        name = key[0]
        root = self.root / f"rtn_{name}"
        shared = {"shared_expert_intermediate_size": 64} if name == "qwen2_moe" else {}
        config = moe_config(name, vocab_size=self.tokenizer.vocab_size, **shared)
        hf_model(config).save_pretrained(root / "src")
        self.tokenizer.save_pretrained(root / "src")
        for method in METHODS:
            over = [f"model.path={root / 'src'}", "calib.samples=2", "calib.seqlen=64"]
            over += ["eval.windows=1", "eval.seqlen=64", "decode.enabled=false"]
            over += [f"{method}.symmetric=true", f"{method}.group_size=16"]
            report = run(compose(f"{method}_int4", over), root / method)
            self[name, method] = (root / "src", root / method, report)
        return self[key]


@pytest.fixture(scope="module")
def rtn_runs(tmp_path_factory, tokenizer):
    """``{(family, method): (source folder, run folder, report)}``: each family (SmolLM2's
    vocabulary, so the pipeline's text applies) through ``recipe=rtn_int4 rtn.symmetric=true``,
    ``recipe=awq_int4 awq.symmetric=true`` and ``recipe=gptq_int4 gptq.symmetric=true``, group
    16."""
    return _Runs(tmp_path_factory.mktemp("rtn_runs"), tokenizer)


# the suite runs the quantized-expert tests on one family; the others are `slow`
QUANT_CASES = [
    f if f == "qwen3_moe" else pytest.param(f, marks=pytest.mark.slow) for f in QUANT_FAMILIES
]


@pytest.mark.parametrize("name", QUANT_CASES)
def test_rtn_quantizes_every_expert_one_tensor_each(rtn_runs, name):
    """The folder holds every expert of every sparse layer as its own compressed-tensors layer,
    whose codes the compressed-tensors library decompresses to the symmetric RTN of that
    expert's source weight (float64 arithmetic, scales rounded to float16 first); the routers
    and qwen2_moe's shared-expert gate stay in floating point."""
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32

    src, folder, report = rtn_runs[name, "rtn"]
    stored = load_file(str(folder / "model.safetensors"))
    source = load_file(str(src / "model.safetensors"))
    spec = spec_of(AutoConfig_from(folder))
    a = spec.adapter
    raw = json.loads((folder / "config.json").read_text())["quantization_config"]
    assert raw["config_groups"]["group_0"]["weights"]["symmetric"] is True
    for layer in spec.layers:
        p = f"model.layers.{layer.index}."
        if layer.mlp != "experts":
            assert p + "mlp.gate_proj.weight_packed" in stored
            continue
        assert stored[p + "mlp.gate.weight"].is_floating_point()  # the router
        for e in range(E):
            for name_ in a.expert_names:
                key = f"{p}mlp.experts.{e}.{name_}"
                on_disk = next(
                    k
                    for k in source
                    if k.endswith(f".experts.{e}.{name_}.weight") and k.startswith(p)
                )
                w = source[on_disk].double()
                shape = tuple(stored[key + ".weight_shape"].tolist())
                codes = unpack_from_int32(stored[key + ".weight_packed"], 4, torch.Size(shape))
                scale = stored[key + ".weight_scale"].double()
                groups = w.view(w.shape[0], -1, 16)
                s = (groups.abs().amax(-1) / 7).half().double()
                want = (groups / s[..., None]).round().clamp(-8, 7)
                assert torch.equal(codes.double().view_as(want), want), key
                assert torch.equal(scale, s)
    if name == "qwen2_moe":
        assert stored["model.layers.1.mlp.shared_expert_gate.weight"].is_floating_point()
        assert "model.layers.1.mlp.shared_expert.down_proj.weight_packed" in stored
    assert report["bits"] == 4 and report["group_size"] == 16


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("name", QUANT_CASES)
def test_quantized_folder_loads_in_transformers_as_in_our_decoder(rtn_runs, name, method):
    """Stock ``from_pretrained`` (no flags: compressed-tensors decompresses the experts) and our
    decoder agree within 1e-3 on an RTN or AWQ folder, at every position whose routing is not a near tie
    (transformers decompresses into float16, whose rounding may flip such a choice, as the
    fp16 caches' may: :func:`untied`); its float16 weights are widened to float32 first."""
    _, folder, report = rtn_runs[name, method]
    hf = AutoModelForCausalLM.from_pretrained(folder).eval()
    for p in hf.parameters():
        if p.is_floating_point():
            p.data = p.data.float()
    ours, _ = load(folder)
    ids = torch.tensor(prompts(1))
    with torch.no_grad():
        got = ours(ids, new_cache(ours, "full", 1, ids.shape[1]))[0]
    want, keep = untied(hf)(ids)
    assert torch.isfinite(got).all() and rel(got[keep], want.float()[keep]) < 1e-3
    sparse = [b.mlp.experts for b in ours.model.layers if isinstance(b.mlp, SparseMoE)]
    assert sparse and all(isinstance(x, QuantExperts) for x in sparse)  # 4-bit in memory
    layers = [m for x in sparse for m in x.modules() if isinstance(m, QuantLinear)]
    assert len(layers) == 2 * E * len(sparse)  # each expert's fused gate_up and its down
    if method != "rtn":  # every expert of every sparse layer saw all calibration tokens
        assert report[f"{method}_experts_fallback"] == {}
        assert set(report[f"{method}_experts_routed"]) == {
            ls.index for ls in spec_of(hf.config).layers if ls.mlp == "experts"
        }


def AutoConfig_from(folder):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(folder)


def stage(recipe: str, model, over: list[str], seed: int = 5):
    """Run ``recipe``'s one stage on ``model`` in place with 8 x 32 random calibration tokens;
    returns the stage's context (its record)."""
    from compress.recipe.pipeline import Context
    from compress.recipe.stages import get_stage
    from tests.conftest import compose

    cfg = compose(recipe, over)
    tokens = torch.randint(1, 300, (8, 32), generator=torch.Generator().manual_seed(seed))
    ctx = Context(cfg=cfg, tokenizer=None, calib_tokens=tokens)
    for name in cfg.stages:
        model = get_stage(name).run(model, ctx)
    return model, ctx


@torch.no_grad()
def inject_outliers(model, channels=(3, 17, 40), factor=20.0) -> None:
    """Outlier channels in every MLP's input, the model's function unchanged: the MLP input
    norm's weight times ``factor`` on ``channels``, every linear it feeds (router, experts'
    gate/up, shared expert and its gate, a dense MLP's gate/up) divided on those columns."""
    ch = list(channels)
    for layer in model.model.layers:
        layer.post_attention_layernorm.weight[ch] *= factor
        for name, p in layer.mlp.named_parameters():
            if name.endswith("down_proj") or name.endswith("down_proj.weight"):
                continue
            if p.dim() == 3:  # fused experts: gate_up_proj [E, 2I, H]
                p[..., ch] /= factor
            elif p.dim() == 2 and p.shape[-1] == model.config.hidden_size:
                p[:, ch] /= factor


@torch.no_grad()
def mlp_error(model, source, ids) -> float:
    """``||MLP_q - MLP|| / ||MLP||`` over every layer: each model's MLP input norm and MLP
    (router, experts, shared expert) applied to the source's residual stream before it."""
    seen = []
    hooks = [
        layer.post_attention_layernorm.register_forward_pre_hook(lambda m, a: seen.append(a[0]))
        for layer in source.model.layers
    ]
    try:
        source(ids)
    finally:
        for h in hooks:
            h.remove()
    out = lambda mlp: mlp[0] if isinstance(mlp, tuple) else mlp  # noqa: E731
    got, want = [], []
    for r, mine, theirs in zip(seen, model.model.layers, source.model.layers):
        got.append(out(mine.mlp(mine.post_attention_layernorm(r))))
        want.append(out(theirs.mlp(theirs.post_attention_layernorm(r))))
    return rel(torch.cat(got), torch.cat(want))


@pytest.mark.parametrize("name", QUANT_FAMILIES)
def test_awq_on_experts_beats_rtn_with_outlier_channels(name):
    """With outlier channels injected into the experts' inputs (the model's function unchanged),
    symmetric AWQ INT4's MLP output error against the source (:func:`mlp_error`: the routers,
    every expert and the shared experts, on held-out random tokens) is at least 30% below
    RTN's, both quantizing every expert (group 16)."""
    shared = {"shared_expert_intermediate_size": 64} if name == "qwen2_moe" else {}
    source = hf_model(moe_config(name, **shared)).eval()
    ids = torch.randint(1, 300, (2, 48), generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        before = source(ids).logits
        inject_outliers(source)
        assert rel(source(ids).logits, before) < 1e-4
    errs = {}
    for recipe, key in (("rtn_int4", "rtn"), ("awq_int4", "awq")):
        over = [f"{key}.symmetric=true", f"{key}.group_size=16"]
        model, _ = stage(recipe, copy.deepcopy(source), over)
        errs[key] = mlp_error(model, source, ids)
    print(f"{name}: MLP output error rtn {errs['rtn']:.4f} awq {errs['awq']:.4f}")  # with -s
    assert errs["awq"] < 0.7 * errs["rtn"], errs


@pytest.mark.parametrize("name", QUANT_FAMILIES)
def test_gptq_on_experts_beats_rtn(name):
    """Symmetric GPTQ INT4 on every expert (group 16, calibrated on 8 x 32 random tokens), with
    outlier channels in the experts' inputs (:func:`inject_outliers`: the uneven input energy
    GPTQ's Hessian weighs): its MLP output error against the source on held-out random tokens
    (:func:`mlp_error`) is below RTN's; every expert's projections are quantized layers; AWQ ->
    GPTQ (awq.quantize=false, then gptq) on experts is too."""
    shared = {"shared_expert_intermediate_size": 64} if name == "qwen2_moe" else {}
    source = hf_model(moe_config(name, **shared)).eval()
    ids = torch.randint(1, 300, (2, 48), generator=torch.Generator().manual_seed(9))
    inject_outliers(source)
    errs = {}
    for recipe in ("rtn_int4", "gptq_int4", "awq_gptq_int4"):
        key = recipe.split("_")[-2]  # awq_gptq_int4: gptq's settings, which awq's follow
        over = [f"{key}.symmetric=true", f"{key}.group_size=16"]
        model, _ = stage(recipe, copy.deepcopy(source), over)
        errs[recipe] = mlp_error(model, source, ids)
        sparse = [b.mlp.experts for b in model.model.layers if hasattr(b.mlp, "experts")]
        assert sparse and all(
            isinstance(getattr(x[e], n), QuantLinear)
            for x in sparse
            for e in range(E)
            for n in x[e].names
        )
    print(f"{name}: MLP output error {errs}")  # with -s
    assert errs["gptq_int4"] < errs["rtn_int4"] and errs["awq_gptq_int4"] < errs["rtn_int4"], errs


def test_gptq_expert_no_token_reaches_falls_back_to_all_tokens():
    """As AWQ's test below: with ``gptq.experts=routed`` DeepSeek V3's experts 4 and 5 of
    layer 1 get no calibration token and fall back to all of them; each is quantized with
    finite scales, and the model's logits are finite."""
    source = hf_model(moe_config("deepseek_v3")).eval()
    with torch.no_grad():
        source.model.layers[1].mlp.gate.e_score_correction_bias[5] = -1000.0
    over = ["gptq.symmetric=true", "gptq.group_size=16", "gptq.experts=routed"]
    model, ctx = stage("gptq_int4", copy.deepcopy(source), over + ["gptq.expert_min_tokens=1"])
    routed = ctx.record["gptq_experts_routed"]
    assert routed[1][4] == routed[1][5] == 0 and sum(routed[1]) == 8 * 32 * K
    assert ctx.record["gptq_experts_fallback"] == {1: [4, 5]}
    experts = model.model.layers[1].mlp.experts
    for e in range(E):
        for n in experts[e].names:
            assert torch.isfinite(getattr(experts[e], n).scales.float()).all()
    with torch.no_grad():
        assert torch.isfinite(model(torch.tensor(prompts(1))).logits).all()


def test_awq_expert_no_token_reaches_falls_back_to_all_tokens():
    """DeepSeek V3's correction bias set to -1000 for expert 5 of layer 1: its router sends it no
    calibration token, nor to expert 4, the other expert of its group (a group scores by its
    two best experts, so the group is never chosen). AWQ with ``awq.experts=routed`` reports 0
    tokens routed to both and falls back to all tokens for them; every expert of the layer is
    quantized, with finite scales, and the quantized model's logits are finite. The default
    (``all``) has no fallback."""

    source = hf_model(moe_config("deepseek_v3")).eval()
    with torch.no_grad():
        source.model.layers[1].mlp.gate.e_score_correction_bias[5] = -1000.0
    over = ["awq.symmetric=true", "awq.group_size=16"]
    routed_over = ["awq.experts=routed", "awq.expert_min_tokens=1"]
    model, ctx = stage("awq_int4", copy.deepcopy(source), over + routed_over)
    routed = ctx.record["awq_experts_routed"]
    assert routed[1][4] == routed[1][5] == 0 and sum(routed[1]) == 8 * 32 * K
    assert min(routed[1][:4] + routed[1][6:]) >= 1
    assert ctx.record["awq_experts_fallback"] == {1: [4, 5]}
    experts = model.model.layers[1].mlp.experts
    for e in range(E):
        for n in experts[e].names:
            layer = getattr(experts[e], n)
            assert isinstance(layer, QuantLinear)
            assert torch.isfinite(layer.scales.float()).all()
    with torch.no_grad():
        assert torch.isfinite(model(torch.tensor(prompts(1))).logits).all()
    _, ctx = stage("awq_int4", copy.deepcopy(source), over)
    assert ctx.record["awq_experts_fallback"] == {} and ctx.record["awq_experts_routed"][1][5] == 0


@pytest.mark.slow
def test_compiled_step_runs_quantized_experts_outside_its_graph(rtn_runs):
    """An RTN folder's compiled decode step: the quantized experts run eager (a graph break),
    every step goes through the compiled step, and its logits equal the eager decoder's over
    the same tokens (one teacher-forced forward) within TOL."""
    _, folder, _ = rtn_runs["qwen3_moe", "rtn"]
    ours, _ = load(folder)
    tokens, logits, _ = ours_greedy(ours, prompts(1), compiled=True)
    assert ours.static_steps[1].compiled_calls == STEPS
    with torch.no_grad():
        want = ours(tokens, new_cache(ours, "full", 1, tokens.shape[1]))
    assert rel(logits, want) < TOL


@pytest.mark.parametrize("family", ["gpt_oss"], indirect=True)
@torch.no_grad()
def test_gpt_oss_sinks_and_clamp_take_part(family):
    """The gpt_oss model that matches transformers above does so with its attention sinks and
    the clamped SwiGLU doing work: without either, its logits move far beyond TOL."""
    name, ours, _, _ = family
    ids = torch.tensor(prompts(1))
    want = ours(ids, new_cache(ours, "full", 1, ids.shape[1]))
    experts = [b.mlp.experts for b in ours.model.layers]
    sinks = [b.self_attn.sinks for b in ours.model.layers]
    saved = [s.clone() for s in sinks]
    try:
        for s in sinks:
            s.fill_(-float("inf"))  # a sink of weight 0
        assert rel(ours(ids, new_cache(ours, "full", 1, ids.shape[1])), want) > 100 * TOL
    finally:
        for s, v in zip(sinks, saved):
            s.copy_(v)
    try:
        for x in experts:
            x.limit = 1e9  # no clamp
        assert rel(ours(ids, new_cache(ours, "full", 1, ids.shape[1])), want) > 100 * TOL
    finally:
        for x in experts:
            x.limit = SWIGLU_LIMIT
    assert torch.equal(ours(ids, new_cache(ours, "full", 1, ids.shape[1])), want)


def test_gpt_oss_quantization_refused(tmp_path):
    """A quantizing recipe on gpt_oss is refused in ``validate``, naming why (its experts'
    layout); an MXFP4 checkpoint is refused before any weight is read, naming the fix."""
    from compress.recipe.config import validate
    from compress.recipe.overrides import compose

    folder = tmp_path / "g"
    hf_model(moe_config("gpt_oss")).save_pretrained(folder)
    for recipe in ("rtn_int4", "awq_int4"):
        key = recipe.split("_")[0]
        over = [f"model.path={folder}", "eval.seqlen=256", f"{key}.symmetric=true"]
        with pytest.raises(CompressError, match="gpt_oss's experts"):
            validate(compose(recipe, over))
    validate(compose("fp", [f"model.path={folder}", "eval.seqlen=256"]))
    mx = write_config(
        tmp_path / "mx", moe_config("gpt_oss"), quantization_config={"quant_method": "mxfp4"}
    )
    with pytest.raises(CompressError, match="mxfp4") as e:
        load(mx)
    assert "safetensors" not in str(e.value)


@pytest.mark.parametrize("kv", ["full", "fp16"])
def test_speculative_greedy_is_the_targets_greedy(family, kv):
    """Self-speculative decoding (the last layer skipped as the draft, gamma 3) on every MoE
    family, gpt_oss's sinks and the sliding windows included: the same 64 greedy tokens as the
    model's own decode, with drafts both accepted and rejected."""
    from compress.decoder.generate import generate
    from compress.decoder.speculative.drafts import LayerSkipDraft
    from compress.decoder.speculative.generate import speculative_generate

    name, ours, _, _ = family
    prompt = [prompts(1)[0][:40]]
    ref = generate(ours, prompt, STEPS, kv=kv, ignore_eos=True)
    draft = LayerSkipDraft(ours, [ours.spec.n_layers - 1])
    r = speculative_generate(ours, prompt, STEPS, kv=kv, ignore_eos=True, draft=draft, gamma=3)
    assert r.tokens == ref.tokens
    assert r.drafted > 0 and 0 < r.acceptance < 1


@pytest.mark.slow
def test_mixtral_folder_with_block_sparse_moe_names_loads(rtn_runs, tmp_path):
    """A compressed-tensors Mixtral folder under the names Mixtral checkpoints (and
    llm-compressor's Mixtral W4A16 folders) use, ``block_sparse_moe.experts.{e}.w1`` ... and
    ``block_sparse_moe.gate``: our decoder loads it to the same logits as our own names."""
    _, folder, _ = rtn_runs["mixtral", "rtn"]
    renamed = tmp_path / "bsm"  # a folder another tool wrote: weights, config, tokenizer
    renamed.mkdir()
    for f in folder.glob("tokenizer*"):
        shutil.copy(f, renamed / f.name)
    state = load_file(str(folder / "model.safetensors"))
    save_file(
        {k.replace(".mlp.", ".block_sparse_moe."): v for k, v in state.items()},
        str(renamed / "model.safetensors"),
    )
    config = json.loads((folder / "config.json").read_text())
    q = config["quantization_config"]
    q["ignore"] = [n.replace(".mlp.", ".block_sparse_moe.") for n in q.get("ignore", [])]
    (renamed / "config.json").write_text(json.dumps(config))
    assert any(
        ".block_sparse_moe.experts.3.w2." in k
        for k in load_file(str(renamed / "model.safetensors"))
    )
    ours, _ = load(folder)
    again, _ = load(renamed)
    ids = torch.tensor(prompts(1))
    with torch.no_grad():
        a = ours(ids, new_cache(ours, "full", 1, ids.shape[1]))
        b = again(ids, new_cache(again, "full", 1, ids.shape[1]))
    assert torch.equal(a, b)
