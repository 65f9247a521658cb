"""Batch-invariant serving: the fixed-order paged attention against float64, the same bits for a
row in any batch; greedy outputs of 16 concurrent requests through the real ``openai`` client
token-identical to the same requests one at a time, in the server's default configuration."""

from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest
import torch

from compress.decoder import runtime
from compress.decoder.model import load
from compress.errors import CompressError
from compress.kernels import native, paged_attn_cpu
from compress.kernels.w4a8_cpu import use
from compress.serve.engine import Engine
from compress.serve.scheduler import Params
from tests.test_decoder import save, tiny_hf, tiny_tokenizer

BUILT = native.library() is not None
pytestmark = pytest.mark.skipif(not BUILT, reason="the C++ kernels did not build")


def rel(a, b) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def problem(B, H, Hkv, T, L, D, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    slots = 4 * L * B
    k = torch.randn(slots, Hkv, D, generator=g).to(dtype)
    v = torch.randn(slots, Hkv, D, generator=g).to(dtype)
    q = torch.randn(B, H, T, D, generator=g)
    gather = torch.stack([torch.randperm(slots, generator=g)[:L] for _ in range(B)])
    lens = torch.randint(1, L + 1, (B,), generator=g)
    start = torch.randint(0, 5, (B,), generator=g)
    pos = torch.arange(T) + int((start + lens).max()) - T
    return q, k, v, gather, paged_attn_cpu.visible(lens, pos, start)


def sink_logits(H: int, seed: int) -> torch.Tensor:
    """gpt-oss's attention sinks: one logit per query head, some above the scores."""
    return torch.randn(H, generator=torch.Generator().manual_seed(seed)) * 2


@pytest.mark.parametrize("sinks", [False, True])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("shape", [(1, 4, 2, 1, 7, 16), (3, 9, 3, 5, 40, 64), (2, 2, 1, 3, 33, 12)])
def test_attention_matches_float64(dtype, shape, sinks):
    q, k, v, gather, hi = problem(*shape, dtype, seed=sum(shape))
    z = sink_logits(shape[1], sum(shape)) if sinks else None
    hi[0, 0] = 0 if hi.shape[1] > 1 else hi[0, 0]  # a padding column
    # into a NaN-poisoned buffer: every element written, so the zeros below are the kernel's
    poisoned = torch.full((*q.shape[:3], v.shape[-1]), float("nan"))
    out = paged_attn_cpu.attention(q, k, v, gather, hi, 0.3, out=poisoned, sinks=z)
    assert out is poisoned
    ref = paged_attn_cpu.reference(q, k, v, gather, hi, 0.3, sinks=z)
    assert torch.isfinite(out).all() and rel(out, ref) < 1e-5
    if sinks:  # the sink takes weight: not the product without it
        assert rel(out, paged_attn_cpu.reference(q, k, v, gather, hi, 0.3)) > 1e-2
    assert not out.transpose(1, 2)[hi == 0].any()  # a padding query (no visible key) gives zeros
    # a latent-attention view: V is K's first channels
    vv = k[..., : shape[-1] // 2]
    assert rel(paged_attn_cpu.attention(q, k, vv, gather, hi, 0.3, sinks=z),
               paged_attn_cpu.reference(q, k, vv, gather, hi, 0.3, sinks=z)) < 1e-5  # fmt: skip


def test_attention_out_buffer_is_checked():
    """``out=`` of another shape, dtype or layout is refused before the kernel writes through it."""
    q, k, v, gather, hi = problem(2, 4, 2, 3, 9, 16, torch.float32, seed=5)
    for bad in (torch.zeros(2, 4, 3, 8), torch.zeros(2, 4, 3, 16, dtype=torch.float64),
                torch.zeros(2, 4, 16, 3).transpose(2, 3)):  # fmt: skip
        with pytest.raises(ValueError, match="contiguous float32 CPU out"):
            paged_attn_cpu.attention(q, k, v, gather, hi, 0.3, out=bad)


def test_a_row_is_the_same_bits_in_any_batch():
    """Row 0 alone, then among other rows with longer contexts, more queries and other thread
    counts: bit-identical."""
    q, k, v, gather, hi = problem(4, 4, 2, 6, 50, 16, torch.float16, seed=3)
    hi[0] = torch.tensor([0, 0, 3, 4, 5, 6])  # row 0: padding columns, then 3..6 keys
    alone = paged_attn_cpu.attention(q[:1, :, 2:], k, v, gather[:1, :6], hi[:1, 2:], 0.25)
    torch.set_num_threads(1)
    batched = paged_attn_cpu.attention(q, k, v, gather, hi, 0.25)
    assert torch.equal(batched[:1, :, 2:], alone)


@pytest.mark.skipif(not native.ops(), reason="the C++ torch operators did not build")
@pytest.mark.parametrize("sinks", [False, True])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize(
    "shape", [(1, 9, 3, 1, 256, 64), (3, 4, 2, 2, 40, 16), (2, 2, 1, 1, 33, 12)]
)
def test_cache_attention_matches_float64(dtype, shape, sinks):
    """``compress::cache_attention`` (the static decode step's attention over a contiguous cache
    read as stored): query (b, t) over slots lo..hi-1 (left padding, a window) against float64;
    and the same bits as the paged kernel over the same keys gathered."""
    B, H, Hkv, T, L, D = shape
    g = torch.Generator().manual_seed(sum(shape))
    k = torch.randn(B, Hkv, L, D, generator=g).to(dtype)
    v = torch.randn(B, Hkv, L, D, generator=g).to(dtype)
    q = torch.randn(B, H, T, D, generator=g).bfloat16()
    hi = torch.randint(L // 2, L + 1, (B, T), generator=g)
    lo = torch.minimum(torch.randint(0, 6, (B, T), generator=g), hi - 1)
    lo[-1] = torch.maximum(lo[-1], hi[-1] - 7)  # a sliding window of 7 on the last row
    z = sink_logits(H, sum(shape)) if sinks else None
    for vv in (v, k[..., : D // 2]):  # and a latent-attention view: V is K's first channels
        out = paged_attn_cpu.cache_attention(q, k, vv, lo, hi, 0.3, sinks=z)
        assert out.dtype == torch.float32 and out.shape == (B, H, T, vv.shape[-1])
        ref = torch.zeros(out.shape, dtype=torch.float64)
        for b in range(B):
            for h in range(H):
                for t in range(T):
                    keys = slice(int(lo[b, t]), int(hi[b, t]))
                    kh, vh = (
                        k[b, h // (H // Hkv), keys].double(),
                        vv[b, h // (H // Hkv), keys].double(),
                    )
                    s = kh @ q[b, h, t].double() * 0.3
                    if sinks:  # a key of logit z[h] and value 0
                        s = torch.cat([s, z[h].double().view(1)])
                    ref[b, h, t] = torch.softmax(s, 0)[: len(vh)] @ vh
        assert torch.isfinite(out).all() and rel(out, ref) < 1e-5
    for t in range(T):  # one query column at a time: the paged kernel over the gathered slots
        width = int((hi[:, t] - lo[:, t]).max())
        idx = (lo[:, t, None] + torch.arange(width)).clamp(max=L - 1)
        gather = (torch.arange(B)[:, None] * L + idx).contiguous()
        pool_k = k.transpose(1, 2).reshape(B * L, Hkv, D)
        pool_v = v.transpose(1, 2).reshape(B * L, Hkv, D)
        paged = paged_attn_cpu.attention(
            q[:, :, t : t + 1], pool_k, pool_v, gather, (hi - lo)[:, t : t + 1], 0.3, sinks=z
        )
        assert torch.equal(paged, paged_attn_cpu.cache_attention(
            q[:, :, t : t + 1], k, v, lo[:, t : t + 1], hi[:, t : t + 1], 0.3, sinks=z))  # fmt: skip


def quantized_folder(tmp_path):
    from compress.methods.quant.rtn import pack_model, quantization_config

    return save(
        pack_model(tiny_hf(vocab_size=320), 4, 32),
        tmp_path / "q4",
        tiny_tokenizer(),
        quantization_config(4, 32),
    )


def prompts(n: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(11)
    return [torch.randint(2, 320, (int(torch.randint(1, 30, (1,), generator=g)),),
                          generator=g).tolist() for _ in range(n)]  # fmt: skip


def test_engine_batched_equals_one_at_a_time(tmp_path):
    folder = quantized_folder(tmp_path)
    exact, _ = load(folder)
    with pytest.raises(CompressError, match="kernel w4a8 and lean"):
        Engine(exact, batch_invariant=True)
    model, tok = load(folder, kernel="w4a8", lean=True, head="int8")
    with pytest.raises(CompressError, match="at every M"):
        Engine(model, batch_invariant=True)  # up to 64 rows only: long prefills would differ
    use(model, "w4a8", every_m=True)
    params = Params(max_tokens=12, ignore_eos=True)
    batched = Engine(model, num_blocks=128, block_size=4, max_seqs=16, max_step_tokens=48,
                     batch_invariant=True).generate(prompts(16), params)  # fmt: skip
    alone = [
        Engine(model, num_blocks=32, block_size=4, batch_invariant=True).generate([p], params)[0]
        for p in prompts(16)
    ]
    assert [s.output for s in batched] == [s.output for s in alone]
    assert len({tuple(s.output) for s in alone}) > 8  # the prompts lead to different texts


@pytest.fixture
def server(tmp_path):
    from compress.serve.app import create_app
    from compress.serve.worker import Worker
    from tests.conftest import serve_in_thread

    openai = pytest.importorskip("openai")
    from compress.serve.__main__ import load_model, parse_args

    args = parse_args([str(quantized_folder(tmp_path))])  # the server's default configuration
    model, tok = load_model(args, "cpu")
    assert args.batch_invariant
    engine = Engine(model, tok, num_blocks=256, block_size=4, max_seqs=16, max_step_tokens=64,
                    batch_invariant=True)  # fmt: skip
    with serve_in_thread(create_app(Worker(engine), tok, "tiny"), 30, "warning") as url:
        yield SimpleNamespace(
            client=openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0), tok=tok
        )


def test_16_concurrent_greedy_requests_equal_one_at_a_time(server):
    texts = [f"the {'quick ' * (i % 5)}brown fox {i} jumps" for i in range(16)]

    def one(i):
        r = server.client.completions.create(
            model="tiny", prompt=texts[i], max_tokens=10 + i % 7, temperature=0
        )
        return r.choices[0].text

    with ThreadPoolExecutor(16) as pool:
        concurrent = list(pool.map(one, range(16)))
    sequential = [one(i) for i in range(16)]
    assert concurrent == sequential
    assert len(set(sequential)) > 4


def test_the_server_defaults_to_the_invariant_configuration_on_a_quantized_folder(
    tmp_path, monkeypatch
):
    """``python -m compress.serve RUN`` on a group-quantized folder on the CPU serves
    batch-invariant in bfloat16 (W4A8 at every M, int8 head); a named setting that rules it out
    (``--dtype float32``, ``--kernel exact``, ``--head none``, prefill ranks,
    ``--no-batch-invariant``) or a vocabulary the int8 head cannot pack turns only invariance
    off; ``--dtype float32``, another device or a plain folder keep the float32 exact path."""
    from compress.methods.quant.rtn import pack_model, quantization_config
    from compress.serve.__main__ import parse_args, resolve_configuration

    q = quantized_folder(tmp_path)
    plain = save(tiny_hf(vocab_size=320), tmp_path / "fp", tiny_tokenizer())

    def resolved(folder, *flags, device="cpu"):
        args = parse_args([str(folder), *flags])
        conf = resolve_configuration(args, device)
        assert (args.batch_invariant, args.dtype, args.kernel) == (
            conf.batch_invariant, conf.dtype, conf.kernel
        )  # fmt: skip
        return conf.fast, conf.batch_invariant, conf.dtype, conf.kernel

    assert resolved(q) == (True, True, "bfloat16", "w4a8")
    assert resolved(q, "--batch-invariant") == (True, True, "bfloat16", "w4a8")
    assert resolved(q, "--dtype", "bfloat16") == (True, True, "bfloat16", "w4a8")
    assert resolved(q, "--dtype", "float32") == (False, False, "float32", "exact")
    for flags in (["--kernel", "exact"], ["--head", "none"], ["--qdtype", "float32"],
                  ["--prefill-ranks", "2"], ["--no-batch-invariant"]):  # fmt: skip
        assert resolved(q, *flags)[1] is False, flags  # ruled out; the rest stays fast
        assert resolved(q, *flags)[2] == "bfloat16", flags
    with pytest.raises(CompressError, match="batch invariance computes"):
        resolved(q, "--batch-invariant", "--kernel", "exact")
    # the rule for a GPU, on a machine that may have none: resolve_runtime checks the device first
    monkeypatch.setattr(runtime, "check_device", lambda name, flag="--device": name)
    assert resolved(q, device="cuda") == (False, False, "float32", "exact")
    assert resolved(plain) == (False, False, "float32", "exact")
    odd = save(pack_model(tiny_hf(), 4, 32), tmp_path / "v300", tiny_tokenizer(),
               quantization_config(4, 32))  # fmt: skip
    assert resolved(odd)[1] is False  # 300 rows: the head cannot be packed, so no invariance
