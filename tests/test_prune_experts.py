"""Minitron for mixture-of-experts models (``compress.methods.prune.experts``): REAP saliency and
each expert's channel importance against an independent float64 computation (transformers'
experts unfused into one module per expert, ``compress.layers.experts``, read by hooks); the
pruned folders load in transformers and in our decoder with equal logits; keeping everything
changes nothing; experts no calibration token reaches score 0 and go first; bad settings are
refused before any weight is read; ``recipe=minitron_experts`` runs prune then distillation."""

import copy

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from compress.decoder.kv import new_cache
from compress.decoder.model import load
from compress.errors import CompressError
from compress.layers.experts import LinearExperts, unfuse_experts
from compress.methods.prune import experts as moe_prune
from tests.test_family_exactness import TOL, prompts, rel
from tests.test_moe import EXPERT, E, K, hf_model, moe_config

FAMILIES = ["qwen3_moe", "qwen2_moe", "mixtral", "olmoe", "deepseek_v3"]


def config(name, **over):
    """The MoE tests' tiny configs; DeepSeek V3's in 2 groups of 4 (half its experts kept: 2 a
    group, as its router needs)."""
    if name == "deepseek_v3":
        over = dict(dict(n_group=2, topk_group=1), **over)
    return moe_config(name, **over)


def tokens(n=6, T=40, seed=3):
    return torch.randint(1, 300, (n, T), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def reference_scores(model, ids) -> dict:
    """REAP saliency, channel importance and routed counts in float64, read off a float64 copy
    whose experts are one module per expert: each expert's output and down projection input
    by hooks, the router's weights from the experts module's arguments."""
    m = copy.deepcopy(model).double()
    a = moe_prune.spec_of(m.config).adapter
    unfuse_experts(m, a)
    acc = {}

    def routing(index):
        def hook(_mod, args):
            acc[index]["route"] = (
                args[1].reshape(-1, args[1].shape[-1]),
                args[2].reshape(-1, args[2].shape[-1]),
            )

        return hook

    def expert_out(index, e):
        def hook(_mod, args, out):
            x = args[0]
            e_idx, w = acc[index]["route"]
            slot, rows = (e_idx.T == e).nonzero(as_tuple=True)  # LinearExperts' row order
            assert x.shape[0] == len(rows)
            acc[index]["sal"][e] += (w[rows, slot].double() * out.norm(dim=-1)).sum()
            acc[index]["n"][e] += len(rows)

        return hook

    def channels(index, e):
        def hook(_mod, args):
            acc[index]["ch"][e] += args[0].abs().sum(0)

        return hook

    handles = []
    for i, layer in enumerate(a.decoder_layers(m)):
        ex = getattr(layer.get_submodule(a.mlp), "experts", None)
        if not isinstance(ex, LinearExperts):
            continue
        acc[i] = dict(
            sal=torch.zeros(E, dtype=torch.float64), n=torch.zeros(E, dtype=torch.float64)
        )
        acc[i]["ch"] = torch.zeros(E, EXPERT, dtype=torch.float64)
        handles.append(ex.register_forward_pre_hook(routing(i)))
        for e in range(E):
            handles.append(ex[e].register_forward_hook(expert_out(i, e)))
            handles.append(
                getattr(ex[e], a.expert_names[2]).register_forward_pre_hook(channels(i, e))
            )
    try:
        m(ids.reshape(-1, ids.shape[-1]))
    finally:
        for h in handles:
            h.remove()
    return {
        i: (s["sal"] / s["n"].clamp(min=1), s["ch"] / s["n"].clamp(min=1)[:, None], s["n"])
        for i, s in acc.items()
    }


@pytest.mark.parametrize("name", FAMILIES)
def test_saliency_matches_float64(name):
    model = hf_model(moe_config(name)).eval()
    ids = tokens()
    got = moe_prune.expert_scores(model, ids, batch_size=4, progress=False)
    want = reference_scores(model, ids)
    assert set(got) == set(want) and got
    for i, (sal, ch, n) in want.items():
        assert torch.equal(got[i]["routed"], n) and n.sum() == ids.numel() * K
        assert rel(got[i]["saliency"], sal) < 1e-5
        assert rel(got[i]["channels"], ch) < 1e-5


def save_pruned(model, keep, width, folder, ids):
    scores = moe_prune.expert_scores(model, ids, progress=False)
    idx = moe_prune.kept(scores, keep, width, moe_prune.spec_of(model.config).moe.n_group)
    pruned = moe_prune.prune_experts(model, idx, keep, width)
    pruned.save_pretrained(folder)
    return scores, idx, pruned


@pytest.mark.parametrize("name", FAMILIES)
@pytest.mark.parametrize("keep, width", [(4, EXPERT), (4, EXPERT // 2)])
def test_pruned_folder_loads_in_transformers_and_ours(name, keep, width, tmp_path):
    """The kept experts are each layer's ``keep`` highest saliencies; the router keeps their rows;
    the folder's config says ``keep`` experts of ``width``; stock transformers and our decoder
    load it with logits within TOL."""
    model = hf_model(config(name)).eval()
    scores, idx, pruned = save_pruned(model, keep, width, tmp_path / "p", tokens())
    a = moe_prune.spec_of(model.config).adapter
    saved = AutoConfig.from_pretrained(tmp_path / "p")
    assert getattr(saved, a.experts_field) == keep
    assert getattr(saved, a.expert_size_field) == width
    groups = 2 if name == "deepseek_v3" else 1
    for i, k in idx.items():
        chosen = []
        for g, sal in enumerate(scores[i]["saliency"].view(groups, -1)):
            order = sal.argsort(descending=True, stable=True)[: keep // groups]
            chosen += (order + g * sal.numel()).tolist()
        assert k["experts"].tolist() == sorted(chosen)
        src = model.model.layers[i].mlp.gate.weight
        assert torch.equal(pruned.model.layers[i].mlp.gate.weight, src[k["experts"]])
        e0 = int(k["experts"][0])
        top = scores[i]["channels"][e0].argsort(descending=True, stable=True)[:width]
        assert k["channels"][0].tolist() == sorted(top.tolist())
        gate_rows = model.model.layers[i].mlp.experts.gate_up_proj[e0][k["channels"][0]]
        assert torch.equal(pruned.model.layers[i].mlp.experts.gate_up_proj[0][:width], gate_rows)
    ref = AutoModelForCausalLM.from_pretrained(
        tmp_path / "p",
        attn_implementation="eager",
        experts_implementation="eager",
        dtype=torch.float32,
    ).eval()
    ours, _ = load(tmp_path / "p")
    ids = torch.tensor(prompts(1))
    with torch.no_grad():
        got = ours(ids, new_cache(ours, "full", 1, ids.shape[1]))
        want = ref(ids).logits
    assert rel(got, want) < TOL
    if name == "deepseek_v3" and width < EXPERT:  # its shared expert narrows with the experts
        assert ref.model.layers[1].mlp.shared_experts.up_proj.out_features == width


@pytest.mark.parametrize("name", ["qwen2_moe", "deepseek_v3"])
def test_keeping_everything_changes_nothing(name):
    model = hf_model(moe_config(name)).eval()
    scores = moe_prune.expert_scores(model, tokens(), progress=False)
    pruned = moe_prune.prune_experts(model, moe_prune.kept(scores, E, EXPERT), E, EXPERT)
    ids = torch.tensor(prompts(1))
    with torch.no_grad():
        assert torch.equal(pruned(ids).logits, model(ids).logits)


def test_expert_no_token_reaches_scores_zero_and_goes_first():
    """DeepSeek V3 with expert 5's correction bias at -1000: no token reaches it nor expert 4,
    its group's other expert; both score 0 and are among the dropped."""
    model = hf_model(moe_config("deepseek_v3")).eval()
    with torch.no_grad():
        model.model.layers[1].mlp.gate.e_score_correction_bias[5] = -1000.0
    scores = moe_prune.expert_scores(model, tokens(), progress=False)
    s = scores[1]
    assert s["routed"][4] == s["routed"][5] == 0 and s["saliency"][4] == s["saliency"][5] == 0
    assert (s["saliency"][[0, 1, 2, 3, 6, 7]] > 0).all()
    kept = moe_prune.kept(scores, 4, EXPERT)[1]["experts"].tolist()
    assert 4 not in kept and 5 not in kept


@pytest.mark.parametrize(
    "name, experts, match",
    [
        ("qwen3_moe", {"keep": 1}, "keep=1 gives 1; it must be a whole number from 2"),
        ("qwen3_moe", {"keep": 9}, "from 2 to the source's 8"),
        ("qwen3_moe", {"intermediate_size": 0}, "intermediate_size=0"),
        ("deepseek_v3", {"keep": 6}, "multiple of 4 experts"),
        ("gpt_oss", {"keep": 4}, "transposed, with biases"),
    ],
)
def test_bad_expert_targets_refused_before_loading(name, experts, match, tmp_path):
    from compress.recipe.config import validate
    from compress.recipe.overrides import compose

    folder = tmp_path / name
    hf_model(moe_config(name)).save_pretrained(folder)
    over = [f"model.path={folder}", "eval.seqlen=256"]
    over += [f"prune.experts.{k}={v}" for k, v in experts.items()]
    with pytest.raises(CompressError, match=match):
        validate(compose("minitron_experts", over))


def test_dense_axes_refused_on_experts_and_experts_on_dense(tmp_path, tiny_dir):
    from compress.recipe.config import validate
    from compress.recipe.overrides import compose

    folder = tmp_path / "q"
    hf_model(moe_config("qwen3_moe")).save_pretrained(folder)
    over = [f"model.path={folder}", "eval.seqlen=256", "prune.target_params=0.5"]
    with pytest.raises(CompressError, match="prune.experts.keep .experts per layer"):
        validate(compose("minitron_experts", over))
    with pytest.raises(CompressError, match="prune cannot run there"):
        validate(compose("minitron_width", [f"model.path={folder}", "eval.seqlen=256"]))
    with pytest.raises(CompressError, match="has no experts"):
        validate(compose("minitron_experts", [f"model.path={tiny_dir}", "eval.seqlen=64"]))


def test_minitron_experts_recipe_prunes_then_distills(tmp_path, tokenizer):
    """The recipe end to end on a tiny OLMoE (SmolLM2's vocabulary): half the experts kept, their
    width halved, then KL distillation from the source; the report names the kept experts and
    the routed counts, and the folder loads in our decoder with the new sizes."""
    from compress.recipe.pipeline import run
    from tests.conftest import compose

    src = tmp_path / "src"
    hf_model(moe_config("olmoe", vocab_size=tokenizer.vocab_size)).save_pretrained(src)
    tokenizer.save_pretrained(src)
    over = [f"model.path={src}", "calib.samples=4", "calib.seqlen=64", "eval.windows=1"]
    over += ["eval.seqlen=64", "decode.enabled=false", "prune.experts.intermediate_size=0.5"]
    over += ["distill.tokens=256", "distill.seqlen=64", "prune.cache=false"]
    report = run(compose("minitron_experts", over), tmp_path / "run")
    p = report["prune"]
    assert p["experts"] == 4 and p["source_experts"] == E and p["expert_width"] == EXPERT // 2
    assert sorted(p["kept_experts"]) == [0, 1] and all(
        len(v) == 4 for v in p["kept_experts"].values()
    )
    assert all(sum(v) == 4 * 64 * K for v in p["routed_tokens"].values())
    assert report["distill"]["steps"] >= 1
    ours, _ = load(tmp_path / "run")
    assert ours.spec.moe.n_experts == 4 and ours.spec.moe.intermediate_size == EXPERT // 2
