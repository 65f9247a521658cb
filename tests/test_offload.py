"""Sequential onloading (compress.io.offload), sharded checkpoints (compress.io.shards), the stored
dtype, and the device settings' errors."""

import json

import pytest
import torch
from omegaconf import OmegaConf
from safetensors.torch import load_file

from compress.errors import CompressError
from compress.eval.perplexity import evaluate
from compress.io import offload
from compress.io.checkpoint import load_run, open_lazy, save_checkpoint, save_entries
from compress.methods.quant.awq import awq
from compress.methods.quant.gptq import gptq
from compress.methods.quant.llm_int8 import llm_int8
from compress.methods.quant.rtn import rtn
from tests.conftest import TINY_OVERRIDES, compose, make_tiny_model


class Ctx:
    """What a stage reads and writes (compress.recipe.pipeline.Context), with fixed calibration tokens."""

    def __init__(self, group: str, settings: dict, device="cpu"):
        self.cfg = OmegaConf.create({group: settings})
        self.device = torch.device(device)
        self.tokens = torch.randint(0, 49152, (4, 32), generator=torch.Generator().manual_seed(3))
        self.quantization_config, self.record = None, {}

    def calibration(self):
        return self.tokens


STAGES = {
    "awq": (
        awq,
        dict(
            bits=4,
            group_size=64,
            duo_scaling=False,
            n_grid=10,
            clip=True,
            search_samples=None,
            batch=2,
        ),
    ),
    "rtn": (rtn, dict(bits=3, group_size=64, symmetric=False)),
    "gptq": (
        gptq,
        dict(
            bits=3,
            group_size=64,
            damp=0.01,
            block_size=32,
            act_order=True,
            true_sequential=True,
            batch=2,
        ),
    ),
    "llm_int8": (llm_int8, dict(threshold=0.05, outlier_stats=True)),
}


def _values(model) -> dict:
    return {e.name: e.get() for e in save_entries(model)}


@pytest.mark.parametrize("stage", list(STAGES))
def test_disk_onloading_equals_whole_model(stage, tiny_dir, tmp_path, monkeypatch):
    """The layers read one at a time from disk give the tensors (AWQ: scales folded into the
    norms, codes, group scales; LLM.int8: codes and SCB) and records of the whole model in
    memory, bit for bit, and at most one layer is ever materialized."""
    fn, settings = STAGES[stage]
    whole = load_run(tiny_dir)[0]
    ctx_whole = Ctx(stage, settings)
    fn(whole, ctx_whole)

    lazy = open_lazy(tiny_dir, spill=tmp_path / "spill")
    layers = lazy.model.layers
    assert all(p.device.type == "meta" for p in layers.parameters())
    real_layer_on = offload.layer_on

    def checked(model, i, device, write=False):
        assert all(t.device.type == "meta" for t in model.model.layers.state_dict().values())
        return real_layer_on(model, i, device, write)

    for mod in (
        "compress.methods.quant.awq",
        "compress.methods.quant.gptq",
        "compress.methods.quant.rtn",
        "compress.methods.quant.llm_int8",
    ):
        monkeypatch.setattr(f"{mod}.layer_on", checked)
    ctx_lazy = Ctx(stage, settings)
    fn(lazy, ctx_lazy)
    a, b = _values(whole), _values(lazy)
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k
    assert ctx_whole.record.keys() == ctx_lazy.record.keys()
    for key in ("awq_alpha", "outliers"):
        assert ctx_whole.record.get(key) == ctx_lazy.record.get(key)


def test_sharded_checkpoint_loads_in_transformers(tmp_path, tokenizer):
    """Shards and an index as save_pretrained writes them: transformers loads the folder
    unchanged, and compress reads it back (whole and layer by layer)."""
    from transformers import AutoModelForCausalLM

    model = make_tiny_model(tie_word_embeddings=False)
    save_checkpoint(model, tokenizer, tmp_path, None, max_shard_bytes=1 << 20)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    shards = sorted(p.name for p in tmp_path.glob("model-*.safetensors"))
    assert len(shards) > 2 and set(index["weight_map"].values()) == set(shards)
    assert not (tmp_path / "model.safetensors").exists()
    reference = model.state_dict()
    assert index["metadata"]["total_size"] == sum(
        t.numel() * t.element_size() for t in reference.values()
    )
    hf = AutoModelForCausalLM.from_pretrained(tmp_path).state_dict()
    ours = load_run(tmp_path)[0].state_dict()
    for k, t in reference.items():
        assert torch.equal(hf[k], t) and torch.equal(ours[k], t), k


def test_disk_backed_evaluation_matches_whole(tiny_dir, tmp_path):
    """Perplexity, KL and top-1 of disk-backed models (layers one at a time, the head a chunk
    of tokens at a time) equal the whole models' within float32 rounding, with the source's
    summary cached (the two share the head) and read back."""
    folder = tmp_path / "rtn"
    model = load_run(tiny_dir)[0]
    ctx = Ctx("rtn", STAGES["rtn"][1])
    rtn(model, ctx)
    save_checkpoint(model, None, folder, ctx.quantization_config)
    windows = torch.randint(0, 49152, (3, 48))
    source = load_run(tiny_dir)[0]
    ref = evaluate(load_run(folder)[0], windows, source)
    cache = tmp_path / "cache"
    for _ in range(2):  # fills the cache, then reads it
        got = evaluate(open_lazy(folder), windows, open_lazy(tiny_dir), cache=cache, source_sha="s")
        for k in ("ppl", "source_ppl", "kl_vs_source", "top1_vs_source"):
            assert got[k] == pytest.approx(ref[k], rel=1e-5, abs=1e-7), k
    # the tensors rtn kept as stored are shared with the source, the figures unchanged
    ours, theirs = open_lazy(folder), open_lazy(tiny_dir)
    theirs.model.norm.weight.data[0] += 1  # one kept tensor the two no longer share
    shared = offload.share_unchanged(ours, theirs)
    assert "model.embed_tokens.weight" in shared and "model.norm.weight" not in shared
    ptr = theirs.model.embed_tokens.weight.data_ptr()
    assert ours.model.embed_tokens.weight.data_ptr() == ptr
    assert ours.lm_head.weight.data_ptr() == ptr  # the tiny model's head is tied
    theirs.model.norm.weight.data[0] -= 1
    got = evaluate(ours, windows, theirs)
    for k in ("ppl", "source_ppl", "kl_vs_source", "top1_vs_source"):
        assert got[k] == pytest.approx(ref[k], rel=1e-5, abs=1e-7), k


def rtn_run(tiny_dir, folder):
    model = load_run(tiny_dir)[0]
    ctx = Ctx("rtn", STAGES["rtn"][1])
    rtn(model, ctx)
    save_checkpoint(model, None, folder, ctx.quantization_config)
    return load_run(folder)[0]


def test_cached_source_summary_is_the_float64_sums_and_replaces_the_source(tiny_dir, tmp_path):
    """With a linear head W (here not the source's: one weight moved), a window's cache entry
    holds, per position, sum p log p, W^T p, argmax p and log p(next) of the source (against
    float64 from its logits), not its log-probs; a later evaluation reads it instead of running
    the source: with every source layer poisoned (NaN) the figures are the clean source's. A
    model with another head gets an entry of its own."""
    from compress.eval.perplexity import _cache_path, _head_sha, _log_probs

    ours = rtn_run(tiny_dir, tmp_path / "rtn")
    with torch.no_grad():
        ours.lm_head.weight = torch.nn.Parameter(ours.lm_head.weight.clone())
        ours.lm_head.weight[5, 3] += 0.5
    source = load_run(tiny_dir)[0]
    windows = torch.randint(0, 49152, (2, 40))
    ref = evaluate(ours, windows, source)
    cache = tmp_path / "cache"
    first = evaluate(ours, windows, source, cache=cache, source_sha="s")
    key = f"s:{_head_sha(ours.lm_head)}"
    assert not _cache_path(cache, "s", windows[0]).exists()  # no log-probs kept
    entry = load_file(str(_cache_path(cache, key, windows[0], "summary")))
    lp = _log_probs(source, windows[0]).double()
    p, w = lp.exp(), ours.lm_head.weight.double()
    expected = {
        "negent": (p * lp).sum(-1),
        "row": p @ w,
        "argmax": lp.argmax(-1),
        "target": lp.gather(1, windows[0, 1:, None])[:, 0],
    }
    for k, v in expected.items():
        got = entry[k].to(v.dtype)
        assert torch.equal(got, v) if k == "argmax" else (got - v).norm() / v.norm() < 1e-5, k
    clean = load_run(tiny_dir)[0]
    with torch.no_grad():
        for layer in source.model.layers:
            for t in layer.parameters():
                t.fill_(float("nan"))
    second = evaluate(ours, windows, source, cache=cache, source_sha="s")
    for k in ("ppl", "source_ppl", "kl_vs_source", "top1_vs_source"):
        assert first[k] == pytest.approx(ref[k], rel=1e-6, abs=1e-9), k
        assert second[k] == pytest.approx(ref[k], rel=1e-5, abs=1e-7), k
    other = load_run(tiny_dir)[0]  # the source's own head: not served the entry above
    third = evaluate(other, windows, clean, cache=cache, source_sha="s")
    assert third["kl_vs_source"] == pytest.approx(0, abs=1e-7)
    assert len(list(cache.iterdir())) == 4


class Wrapped(torch.nn.Module):
    """A head that is not an ``nn.Linear`` (as a quantized head is not)."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return self.inner(x)


def test_a_head_that_is_not_linear_keeps_the_sources_log_probs(tiny_dir, tmp_path):
    """A compressed head that is not a plain linear map: the cache keeps the source's log-probs,
    from whole and disk-backed sources alike, and the figures are unchanged."""
    from compress.eval.perplexity import _cache_path, _log_probs, linear_head

    ours = rtn_run(tiny_dir, tmp_path / "rtn")
    ours.lm_head = Wrapped(ours.lm_head)
    assert linear_head(ours) is None
    source = load_run(tiny_dir)[0]
    windows = torch.randint(0, 49152, (2, 40))
    ref = evaluate(ours, windows, source)
    cache = tmp_path / "cache"
    for _ in range(2):
        got = evaluate(ours, windows, source, cache=cache, source_sha="s")
        for k in ("ppl", "source_ppl", "kl_vs_source", "top1_vs_source"):
            assert got[k] == pytest.approx(ref[k], rel=1e-6, abs=1e-9), k
    stored = load_file(str(_cache_path(cache, "s", windows[1])))["log_probs"]
    torch.testing.assert_close(stored, _log_probs(source, windows[1]), rtol=1e-5, atol=1e-5)
    lazy_cache = tmp_path / "lazy"
    got = evaluate(ours, windows, open_lazy(tiny_dir), cache=lazy_cache, source_sha="s")
    assert got["kl_vs_source"] == pytest.approx(ref["kl_vs_source"], rel=1e-5)
    stored = load_file(str(_cache_path(lazy_cache, "s", windows[1])))["log_probs"]
    torch.testing.assert_close(stored, _log_probs(source, windows[1]), rtol=1e-5, atol=1e-5)


def test_stored_dtype_is_kept(tmp_path, tokenizer):
    """model.dtype=auto loads a bfloat16 folder in bfloat16; a disk-backed one keeps its
    embedding 16-bit and widens each layer to float32 exactly when it is onloaded."""
    from compress.io.source import load_lazy, load_model

    model = make_tiny_model().to(torch.bfloat16)
    model.save_pretrained(tmp_path / "bf16")
    tokenizer.save_pretrained(tmp_path / "bf16")
    whole = load_model(str(tmp_path / "bf16"))[0]
    assert whole.model.layers[0].mlp.up_proj.weight.dtype == torch.bfloat16
    lazy = load_lazy(str(tmp_path / "bf16"))[0]
    assert lazy.model.embed_tokens.weight.dtype == torch.bfloat16
    with offload.layer_on(lazy, 1, "cpu") as layer:
        w = layer.mlp.up_proj.weight
        assert w.dtype == torch.float32
        assert torch.equal(w, model.model.layers[1].mlp.up_proj.weight.float())
    assert lazy.model.layers[1].mlp.up_proj.weight.device.type == "meta"


def test_pipeline_offload_disk_run(tiny_dir, tmp_path):
    """A recipe with offload=disk writes the same run folder tensors as offload=host."""
    from compress.recipe.pipeline import run

    reports = {}
    for where in ("disk", "host"):
        cfg = compose(
            "rtn_int4",
            [f"model.path={tiny_dir}", *TINY_OVERRIDES, f"offload={where}", "decode.enabled=false"],
        )
        reports[where] = run(cfg, tmp_path / where)
        assert reports[where]["offload"] == where
        assert not list(tmp_path.glob(f".{where}.layers-*"))  # the spill folder is removed
    a = load_file(str(tmp_path / "disk" / "model.safetensors"))
    b = load_file(str(tmp_path / "host" / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    for k in ("ppl", "kl_vs_source", "top1_vs_source"):
        assert reports["disk"][k] == pytest.approx(reports["host"][k], rel=1e-5)


def test_device_errors(tiny_dir, monkeypatch):
    """device=cuda without a GPU, offload=disk with a whole-model stage, and a GPU too small
    for one layer are refused before any work, naming the fix (and the layer's size)."""
    from compress.recipe.config import validate

    if not torch.cuda.is_available():
        with pytest.raises(CompressError, match="device=cuda.*no usable GPU"):
            validate(compose("rtn_int4", [f"model.path={tiny_dir}", "device=cuda"]))
    with pytest.raises(CompressError, match="offload=disk.*whole model"):
        validate(compose("minitron_width", [f"model.path={tiny_dir}", "offload=disk"]))
    model = open_lazy(tiny_dir)
    size = offload.layer_bytes(model)
    assert size == 4 * sum(p.numel() for p in make_tiny_model().model.layers[0].parameters())
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (size // 2, 10 * size))
    expected = rf"one decoder layer needs {size / 2**20:.1f} MiB in float32.*device=cpu"
    with pytest.raises(CompressError, match=expected):
        offload.check_fits(model, "cuda", 0, "awq")


def test_accelerate_launch_refuses_single_process_stages(tiny_dir, monkeypatch):
    """Under `accelerate launch` (WORLD_SIZE > 1) a recipe whose stages run in one process is
    refused before any work; a distillation recipe passes the check."""
    from compress.recipe.config import check_distributed, validate

    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(CompressError, match="started 2 processes.*\\['awq'\\].*python -m compress"):
        validate(compose("awq_int4", [f"model.path={tiny_dir}"]))
    assert check_distributed(compose("minitron_width", [f"model.path={tiny_dir}"])) == 2


def test_head_log_probs_match_float64_and_name_a_bad_head():
    """The chunked head (vocabulary slices of 7 rows) is log_softmax(h W^T) of float64; a NaN in
    the head is reported by the head's name, not by a NaN perplexity."""
    model = make_tiny_model(tie_word_embeddings=False)
    h = torch.randn(5, model.config.hidden_size, generator=torch.Generator().manual_seed(3))
    w = model.lm_head.weight.detach()
    reference = torch.log_softmax(h.double() @ w.double().t(), dim=-1)
    got = offload.head_log_probs(model, h, vocab_chunk=7)
    assert ((got.double() - reference).norm() / reference.norm()).item() < 1e-6
    with torch.no_grad():
        model.lm_head.weight[11, 2] = float("nan")
    with pytest.raises(CompressError, match=r"lm_head.weight' contains NaN"):
        offload.head_log_probs(model, h, vocab_chunk=7)


def test_disk_backed_evaluation_applies_the_final_softcap(tmp_path):
    """A model whose config caps its logits (``final_logit_softcapping``, kept by Gemma 3's
    modeling code): the disk-backed evaluation's perplexity is transformers' own, capped."""
    from tests.family_models import VOCAB, family_model

    model = family_model("gemma3_text", final_logit_softcapping=0.3)
    model.save_pretrained(tmp_path / "capped")
    windows = torch.randint(0, VOCAB, (2, 40), generator=torch.Generator().manual_seed(7))

    def ppl():  # transformers' forward, in float64 from its logits
        with torch.no_grad():
            logits = model(windows).logits[:, :-1].double()
        return torch.exp(-torch.log_softmax(logits, -1).gather(2, windows[:, 1:, None]).mean())

    capped = ppl().item()
    got = evaluate(open_lazy(tmp_path / "capped"), windows)
    assert got["ppl"] == pytest.approx(capped, rel=1e-5)
    model.config.final_logit_softcapping = None
    assert abs(ppl().item() - capped) > 1e-3 * capped  # the cap changes the figure
