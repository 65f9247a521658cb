"""The built-in decoder on attention-converted folders (gqa, cla, mla), against transformers
running the same folders (plain Llama, or the folder's own modeling files)."""

import shutil

import pytest
import torch

from compress.decoder.generate import generate
from compress.decoder.kv import new_cache
from compress.decoder.model import load
from compress.eval.kv_quality import HistoryMix
from tests.test_decoder import rel_err, save, tiny_hf, tiny_tokenizer


def convert(kind: str):
    """(converted HF model, files its folder carries) of a tiny 4-layer Llama, head_dim 16."""
    from compress.formats.attention import folder_files
    from compress.methods.attn.cla import convert_cla
    from compress.methods.attn.gqa import mean_pool_kv
    from compress.methods.attn.mla import convert_mla, full_rank

    hf = tiny_hf(num_hidden_layers=4, max_position_embeddings=512)
    tokens = torch.randint(0, 300, (4, 32), generator=torch.Generator().manual_seed(1))
    if kind == "gqa":
        return mean_pool_kv(hf, 1), {}
    if kind == "cla":
        out = convert_cla(hf, 2, "lstsq", tokens)
    elif kind == "mla":
        out = convert_mla(hf, d_kv=6, rope_pairs=2, rope_select="2norm", tokens=tokens)
    else:  # mla at full rank with every pair kept: the source model itself
        out = convert_mla(hf, d_kv=full_rank(hf.config, 8), rope_pairs=8, rope_select="uniform")
    return out, folder_files(out.config.model_type)


def converted(kind: str, folder):
    """(the converted HF model, our decoder's model of its saved folder)."""
    hf, files = convert(kind)
    save(hf, folder, tiny_tokenizer())
    for name, src in files.items():
        shutil.copyfile(src, folder / name)
    return hf, load(folder)[0]


@pytest.mark.parametrize("kind", ["gqa", "cla", "mla", "mla-full"])
def test_decoder_matches_transformers_on_converted(kind, tmp_path):
    """Prefill then one token at a time (the absorbed latent path for mla) against transformers'
    logits over the whole sequence (mla: K/V expanded from the latent), and the cache holds
    exactly the kind's bytes per token."""
    hf, ours = converted(kind, tmp_path)
    folder = tmp_path
    ids = torch.randint(2, 300, (2, 24), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref = hf(ids).logits
        cache = new_cache(ours, "fp16", 2, 24)
        out = torch.cat(
            [ours(ids[:, :16], cache)] + [ours(ids[:, t : t + 1], cache) for t in range(16, 24)], 1
        )
    assert rel_err(out, ref) < 2e-3  # the fp16 cache
    with torch.no_grad():
        full = new_cache(ours, "full", 2, 24)
        out = torch.cat(
            [ours(ids[:, :16], full)] + [ours(ids[:, t : t + 1], full) for t in range(16, 24)], 1
        )
    assert rel_err(out, ref) < 1e-5
    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=kind != "gqa").eval()
    long = torch.randint(2, 300, (1, 256), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():  # the folder as transformers reads it, on 256 tokens
        assert rel_err(ours(long, new_cache(ours, "full", 1, 256)), loaded(long).logits) < 1e-4
    c = hf.config
    per_layer = {
        "gqa": 2 * 1 * 16,
        "cla": 2 * 2 * 16 / 2,
        "mla": getattr(c, "kv_lora_rank", 0)
        + 2 * getattr(c, "mla_rope_pairs", 0) * c.num_key_value_heads,
    }
    per_layer["mla-full"] = per_layer["mla"]
    assert cache.nbytes() == 2 * 24 * c.num_hidden_layers * per_layer[kind] * 2


@pytest.mark.parametrize("kind", ["cla", "mla"])
def test_compiled_step_on_converted(kind, tmp_path):
    """The compiled decode step runs the same attention kinds: identical greedy tokens."""
    hf, ours = converted(kind, tmp_path)
    prompts = [[5, 6, 7, 8, 9, 10], [11, 12, 13]]
    eager = generate(ours, prompts, 12, kv="full")
    assert generate(ours, prompts, 12, kv="full", compile=True).tokens == eager.tokens


def test_latent_attention_refuses_compressed_caches(tmp_path):
    from compress.errors import CompressError

    hf, ours = converted("mla", tmp_path)
    with pytest.raises(CompressError, match="fp16 or full"):
        generate(ours, [[5, 6, 7]], 4, kv="kivi")


@pytest.mark.parametrize("kind", ["cla", "mla"])
def test_kv_quality_parallel_pass_runs_converted_models(kind, tmp_path):
    """kv_quality --models: the one-pass view of an fp16 cache gives a converted model's logits as
    its real fp16 cache does, with the same bytes (cross-layer slots read twice, a latent key)."""
    hf, ours = converted(kind, tmp_path)
    ids = torch.randint(2, 300, (2, 40), generator=torch.Generator().manual_seed(3))
    mix = HistoryMix("fp16", {}, torch.zeros(40, dtype=torch.long), 2, ours.kv_layout())
    cache = new_cache(ours, "fp16", 2, 40)
    with torch.no_grad():
        assert rel_err(ours(ids, mix), ours(ids, cache)) < 1e-5
    assert mix.held == cache.nbytes()


def test_absorbed_latent_decode_equals_expanded_every_step(tmp_path):
    """A 64-token greedy run of the decoder (latent attention absorbed, one token a step): at every
    step its logits equal transformers' (K/V expanded from the latent) on the same tokens."""
    hf, ours = converted("mla", tmp_path)
    ids = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 12]])
    cache = new_cache(ours, "full", 1, ids.shape[1] + 64)
    steps = []
    with torch.no_grad():
        logits = ours(ids, cache)[:, -1:]
        for _ in range(64):
            steps.append(logits)
            ids = torch.cat([ids, logits.argmax(-1)], 1)
            logits = ours(ids[:, -1:], cache)
        ref = hf(ids).logits[:, 7:-1]
    errs = [rel_err(a, ref[:, t : t + 1]) for t, a in enumerate(steps)]
    assert max(errs) < 1e-5, errs


def test_quantized_cross_layer_folder_composes(tiny_dir, tmp_path):
    """rtn_int4 on a cla run folder: the pipeline quantizes it and evaluates it, and the decoder
    runs the result as transformers' loader of the same folder does."""
    import compress
    from compress.io.checkpoint import load_run

    tiny = {
        "eval": {"windows": 2, "seqlen": 64},
        "calib": {"samples": 4, "seqlen": 64},
        "decode": {"enabled": False},
    }
    cla = compress.run("cla", model=tiny_dir, out=tmp_path / "cla", distill={"tokens": 0}, **tiny)
    int4 = compress.run("rtn_int4", model=cla.path, out=tmp_path / "int4", **tiny)
    assert int4.report["ppl"] > 0
    ours, _ = load(int4.path)
    ref, _ = load_run(int4.path)
    ids = torch.randint(0, 49152, (1, 40), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        assert rel_err(ours(ids, new_cache(ours, "full", 1, 40)), ref(ids).logits) < 1e-4
