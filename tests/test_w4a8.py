"""The W4A8 kernel (int8 activations x INT3/INT4/INT8 codes) against float64 references of the
same quantized arithmetic, on every path this machine runs; its wiring into the layers, the
compiled step and lean loading; a machine without a compiler."""

import json
import math
from types import SimpleNamespace

import pytest
import torch

from compress.decoder.runtime import FAST_KERNEL
from compress.errors import CompressError
from compress.kernels import cpu, native, w4a8_cpu, w4a8_ref
from compress.layers import QuantLinear

C_PATHS = [p for p in ("vnni", "avx2", "portable") if p in w4a8_cpu.available()]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def random_layer(
    bits: int, K: int, N: int, g: int, seed: int, symmetric: bool = False
) -> QuantLinear:
    """Random codes, fp16 scales, and random zero points (or one, ``symmetric``: the kernel's
    form with fp16 scales, ``w4a8_cpu.prepare``)."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 2**bits, (N, K), generator=gen)
    z = torch.randint(0, 2**bits, (N, K // g), generator=gen)
    if symmetric:
        z = torch.full_like(z, 2 ** (bits - 1))
    s = (torch.rand(N, K // g, generator=gen) * 0.02 + 1e-3).half()
    return QuantLinear.from_quantized(
        SimpleNamespace(q=q, zeros=z, scales=s, bits=bits, group_size=g)
    )


def x_hat64(x: torch.Tensor, g: int) -> torch.Tensor:
    """The activations the kernel multiplies, from first principles in float64: per token and
    32-channel block, ``round(x * 127 / absmax) * absmax / 127``."""
    x = x.double()
    M, K = x.shape
    b = x.reshape(M, K // 32, 32)
    amax = b.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, (127.0 / amax.float()).double(), 0.0)  # fp32 like the kernel
    q = torch.round((b.float() * inv.float()).double())
    return (q * (amax.float() / 127.0).double()).reshape(M, K)


def test_packing_round_trips_through_the_portable_reading():
    """``pack`` puts code q[i, o] where the docstring says: unpack it again in PyTorch."""
    for bits in (3, 4, 8):
        gen = torch.Generator().manual_seed(bits)
        q = torch.randint(0, 2**bits, (64, 32), generator=gen, dtype=torch.int32)
        p = w4a8_cpu.pack(q, bits).to(torch.int32)  # [T, B, bytes]
        T, B = p.shape[:2]
        back = torch.empty_like(q)
        for i in range(64):
            b, k, u = i // 32, i % 32, i % 4
            for o in range(32):
                t, j = o // 16, o % 16
                blk = p[t, b]
                if bits == 8:
                    v = blk[(k // 4) * 64 + 4 * j + u]
                elif bits == 4:
                    v = (blk[(k // 8) * 64 + 4 * j + u] >> (4 * ((k // 4) % 2))) & 15
                else:
                    r = k // 4
                    v = ((blk[(r // 4) * 64 + 4 * j + u] >> (2 * (r % 4))) & 3) | (
                        ((blk[128 + 4 * j + u] >> r) & 1) << 2
                    )
                back[i, o] = v
        assert torch.equal(back, q), bits


def test_reference_quantizes_as_specified():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(3, 128, generator=gen) * torch.rand(3, 128, generator=gen) * 4
    x[1, 32:64] = 0  # an all-zero block: codes 0, scale 0
    xq, d, xs = w4a8_ref.quantize(x, 64)
    assert xq.dtype == torch.int8 and xq.abs().max() <= 127 and not xq[1, 32:64].any()
    assert rel(w4a8_ref.dequantized(x, 64), x_hat64(x, 64)) < 1e-12
    assert rel(w4a8_ref.dequantized(x, 64), x) < 1e-2  # int8 per 32 channels: ~0.4% off
    sums = (xq.double().reshape(3, 4, 32).sum(-1) * d.double()).reshape(3, 2, 2).sum(-1)
    assert rel(xs, sums) < 1e-6


@pytest.mark.skipif(not C_PATHS, reason="the C++ kernels did not build")
@pytest.mark.parametrize("path", C_PATHS)
@pytest.mark.parametrize("bits", [3, 4, 8])
@pytest.mark.parametrize("shape", [(64, 32, 32), (256, 96, 128), (576, 224, 64), (160, 160, 160)])
@pytest.mark.parametrize("symmetric", [False, True])
def test_kernel_matches_float64_reference(path, bits, shape, symmetric, monkeypatch):
    """Every C++ path, both forms of the scales (fp32 s and s z; fp16 s of symmetric codes), M in
    1, 2, 4, 8, 17 (and odd shapes: 7 or 14 tiles, 5 blocks per group), into poisoned outputs:
    ``x_hat @ W_hat^T`` in float64 to fp32 accuracy."""
    monkeypatch.setenv("COMPRESS_W4A8", path)
    K, N, g = shape
    layer = random_layer(bits, K, N, g, seed=bits * 7 + K, symmetric=symmetric)
    layer.kernel = "w4a8"
    packed, s, sz = w4a8_cpu.form(layer)
    half = s.dtype == torch.float16
    assert half == symmetric and (sz.numel() == 1) == symmetric  # the form taken
    w64 = layer.dequantize(torch.float64)
    lib = native.library()
    for M in (1, 2, 4, 8, 17):
        gen = torch.Generator().manual_seed(M)
        x = torch.randn(M, K, generator=gen) * (1 + 3 * torch.rand(M, K, generator=gen))
        ref = x_hat64(x, g) @ w64.t()
        xq, d, xs = (torch.full((M, K), -77, dtype=torch.int8),) + tuple(
            torch.full(shape, math.nan) for shape in ((M, K // 32), (M, K // g))
        )
        y = torch.full((M, N), math.nan)
        lib.w4a8_linear(
            x.data_ptr(), xq.data_ptr(), d.data_ptr(), xs.data_ptr(),
            packed.data_ptr(), s.data_ptr(), sz.data_ptr(), y.data_ptr(),
            M, K, N, g, bits, w4a8_cpu.PATHS[path], 2, half,
        )  # fmt: skip
        assert torch.isfinite(y).all()
        assert rel(y, ref) < 2e-6, (M, rel(y, ref))
        assert torch.equal(
            xq, w4a8_ref.quantize(x, g)[0]
        )  # the kernel's rounding is the reference's
        # through the layer: the same numbers, in the input's dtype
        out = layer(x.bfloat16())
        assert (
            out.dtype == torch.bfloat16
            and rel(out, x_hat64(x.bfloat16().float(), g) @ w64.t()) < 4e-3
        )


@pytest.mark.skipif(not C_PATHS, reason="the C++ kernels did not build")
@pytest.mark.parametrize("path", C_PATHS)
@pytest.mark.parametrize("bits", [3, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_symmetric_scales_float16_cannot_hold_keep_their_values(path, bits, dtype, monkeypatch):
    """Symmetric codes whose scales fp16 does not hold exactly (fp32 ones with 24-bit mantissas;
    bf16 ones below fp16's normal range, where it keeps a few bits): the kernel takes the fp32
    form and computes with the scales as they are, to fp32 accuracy against ``x_hat @ W^T`` in
    float64 built from the codes, the zero point and those scales."""
    monkeypatch.setenv("COMPRESS_W4A8", path)
    K, N, g = 128, 64, 32
    gen = torch.Generator().manual_seed(40 + bits)
    q = torch.randint(0, 2**bits, (N, K), generator=gen)
    z = torch.full((N, K // g), 2 ** (bits - 1))
    if dtype == torch.float32:
        s = torch.rand(N, K // g, generator=gen, dtype=torch.float64) * 0.02 + 1e-3
    else:  # 1e-7 .. 6e-6: fp16 subnormals, spaced 6e-8 apart
        s = torch.rand(N, K // g, generator=gen, dtype=torch.float64) * 6e-6 + 1e-7
    s = s.to(dtype)
    assert not torch.equal(s.half().to(dtype), s)  # fp16 would round them
    layer = QuantLinear.from_quantized(
        SimpleNamespace(q=q, zeros=z, scales=torch.zeros(N, K // g), bits=bits, group_size=g)
    )
    layer.scales = s.t().contiguous()  # as a checkpoint's scales load: [K/g, N] in their dtype
    layer.kernel = "w4a8"
    w64 = (q - z.repeat_interleave(g, 1)).double() * s.double().repeat_interleave(g, 1)
    for M in (1, 5):
        gen = torch.Generator().manual_seed(1000 + M)
        x = torch.randn(M, K, generator=gen) * (1 + 3 * torch.rand(M, K, generator=gen))
        y = layer(x)
        assert y.dtype == torch.float32 and torch.isfinite(y).all()
        assert rel(y, x_hat64(x, g) @ w64.t()) < 2e-6, (M, rel(y, x_hat64(x, g) @ w64.t()))


@pytest.mark.skipif(not C_PATHS, reason="the C++ kernels did not build")
@pytest.mark.parametrize("path", C_PATHS)
@pytest.mark.parametrize("bits", [3, 4, 8])
@pytest.mark.parametrize("symmetric", [False, True])
def test_operator_matches_float64_reference_in_every_dtype(path, bits, symmetric):
    """``compress::w4a8_linear`` (the C++ operator the compiled step calls) on every path and
    form of the scales: fp32, bf16 (read as it is) and fp16 (converted) inputs of any leading
    shape, against the float64 reference of the same arithmetic, and bit for bit what the
    ctypes call computes."""
    K, N, g = 192, 96, 64  # 6 tiles
    layer = random_layer(bits, K, N, g, seed=bits + 11, symmetric=symmetric)
    packed, s, sz = w4a8_cpu.form(layer)
    w64 = layer.dequantize(torch.float64)
    for M in (1, 3, 6):
        gen = torch.Generator().manual_seed(100 + M)
        x = torch.randn(M, K, generator=gen) * (1 + 3 * torch.rand(M, K, generator=gen))
        for dtype, tol in ((torch.float32, 2e-6), (torch.bfloat16, 8e-3), (torch.float16, 2e-3)):
            xt = x.to(dtype)
            y = w4a8_cpu.linear(xt.reshape(M, 1, K), packed, s, sz, bits, g, path)
            assert y.dtype == dtype and y.shape == (M, 1, N) and torch.isfinite(y).all()
            y = y.reshape(M, N)
            assert rel(y, x_hat64(xt.float(), g) @ w64.t()) < tol, (dtype, M)
            via_ctypes = w4a8_cpu.ctypes_linear(xt, packed, s, sz, bits, g, w4a8_cpu.PATHS[path])
            assert torch.equal(y, via_ctypes.to(dtype)), (dtype, M)


def test_operator_falls_back_to_ctypes_where_it_does_not_build(tmp_path):
    """Where the C++ operator does not build (but the kernels do): one warning, and the same
    op, defined in Python over the ctypes call, computes the same numbers (a fresh process)."""
    import subprocess
    import sys

    script = tmp_path / "fallback.py"
    script.write_text(
        """
import warnings, torch
import compress.kernels.native as native
from compress.kernels import w4a8_cpu
real = native._compile
def broken(name, sources, capability=None):
    if name == "compress_cpu_ops":
        raise native.BuildError("simulated: the operator's sources do not compile")
    return real(name, sources, capability)
native._compile = broken
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    op = w4a8_cpu.op()
    w4a8_cpu.op()
msgs = [str(w.message) for w in caught if "operators" in str(w.message)]
assert len(msgs) == 1 and "simulated" in msgs[0] and "ctypes" in msgs[0], msgs
gen = torch.Generator().manual_seed(0)
q = torch.randint(0, 16, (128, 64), generator=gen, dtype=torch.int32)
packed = w4a8_cpu.pack(q, 4)
s = torch.rand(2, 64, generator=gen) * 0.02
sz = s * torch.randint(0, 16, (2, 64), generator=gen)
x = torch.randn(3, 128, generator=gen)
y = op(x.bfloat16(), packed, s, sz, 4, 64, 2 if "vnni" in w4a8_cpu.available() else 0)
ref = w4a8_cpu.ctypes_linear(x.bfloat16(), packed, s, sz, 4, 64, 2 if "vnni" in w4a8_cpu.available() else 0)
assert y.dtype == torch.bfloat16 and torch.equal(y, ref.bfloat16())
from compress.kernels import skinny_cpu  # the skinny kernel's op falls back the same way
if skinny_cpu.path() != "ref":
    x2, w2 = torch.randn(3, 64, generator=gen), torch.randn(20, 64, generator=gen)
    y2 = skinny_cpu.linear(x2, w2, None)
    assert torch.equal(y2, skinny_cpu._ctypes_op(x2, w2, None, skinny_cpu.PATHS[skinny_cpu.path()]))
print("fallback ok")
"""
    )
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0 and "fallback ok" in out.stdout, out.stderr[-2000:]


def test_layer_dispatch_and_the_pytorch_path(monkeypatch):
    """``kernel="w4a8"`` sends small M through the kernel, large M through the exact path;
    ``COMPRESS_W4A8=ref`` runs the PyTorch arithmetic; an unknown path is refused."""
    layer = random_layer(4, 128, 64, 64, seed=3)
    x = torch.randn(3, 128)
    exact = x.double() @ layer.dequantize(torch.float64).t()
    assert cpu.cpu_path(x, layer) != "w4a8" and rel(layer(x), exact) < 1e-6
    layer.kernel = "w4a8"
    big = torch.randn(cpu.W4A8_MAX_M + 1, 128)
    if C_PATHS:
        assert cpu.cpu_path(x, layer) == "w4a8" and cpu.cpu_path(big, layer) != "w4a8"
    ref = x_hat64(x, 64) @ layer.dequantize(torch.float64).t()
    assert rel(layer(x), ref) < 2e-6 and rel(layer(x), exact) > 1e-4  # not the exact product
    monkeypatch.setenv("COMPRESS_W4A8", "ref")
    assert rel(layer(x), ref) < 2e-6
    monkeypatch.setenv("COMPRESS_KERNELS", "ref")
    assert rel(layer(x), ref) < 2e-6
    monkeypatch.delenv("COMPRESS_KERNELS")
    monkeypatch.setenv("COMPRESS_W4A8", "sse9")
    with pytest.raises(CompressError, match="COMPRESS_W4A8=sse9"):
        layer(x)


def test_use_sets_the_kernel_where_it_fits():
    model = torch.nn.Sequential(random_layer(4, 128, 64, 64, 1), random_layer(4, 96, 64, 48, 2))
    assert w4a8_cpu.use(model, "w4a8") == 1  # group size 48 is no whole number of 32-blocks
    assert [m.kernel for m in model] == ["w4a8", "exact"]
    assert w4a8_cpu.use(model, "exact") == 2 and {m.kernel for m in model} == {"exact"}
    with pytest.raises(CompressError, match="kernel='w8a8'"):
        w4a8_cpu.use(model, "w8a8")


@pytest.mark.skipif(not C_PATHS, reason="the C++ kernels did not build")
@pytest.mark.parametrize("bits", [3, 4, 8])
@pytest.mark.parametrize("symmetric", [False, True])
def test_lean_w4a8_and_the_compiled_op(bits, symmetric):
    """Lean loading keeps only the W4A8 form (either form of the scales): small M through the
    kernel, long prefills through its exact dequantization (``w4a8-dequant``), every M through
    the kernel with ``kernel_every_m``; the op that the compiled step traces computes the same
    as the layer."""
    layer = random_layer(bits, 128, 64, 32, seed=4, symmetric=symmetric)
    w64 = random_layer(bits, 128, 64, 32, seed=4, symmetric=symmetric).dequantize(torch.float64)
    packed, s, sz = w4a8_cpu.form(layer)
    assert torch.equal(w4a8_cpu.unpack(packed, bits), layer.codes()[0])  # pack's inverse
    layer.kernel = "w4a8"
    x = torch.randn(cpu.W4A8_MAX_M + 36, 128)
    before = layer(x[:5])
    cpu.keep_lean_form(layer)
    assert layer.cache["lean"] == "w4a8" and all(
        t.numel() == 0 for n, t in layer._buffers.items() if n.startswith("qweight")
    )
    assert torch.equal(layer(x[:5]), before)
    assert cpu.cpu_path(x, layer) == "w4a8-dequant"
    assert rel(layer(x), x.double() @ w64.t()) < 1e-6  # exact: no activation rounding
    assert rel(layer(x.bfloat16()), x.bfloat16().double() @ w64.t()) < 1e-2
    layer.kernel_every_m = True
    assert rel(layer(x), x_hat64(x, 32) @ w64.t()) < 2e-6
    mod = w4a8_cpu.W4A8Linear(layer)
    compiled = torch.compile(mod, fullgraph=True)
    assert torch.equal(compiled(x[:5].reshape(5, 1, 128)).reshape(5, 64), before)


def test_no_compiler_keeps_the_exact_path_with_one_warning(monkeypatch):
    """A machine without a C++ compiler: one warning, then ``kernel="w4a8"`` layers compute the
    exact product (the path they had)."""
    monkeypatch.setattr(native, "_LIB", {})
    monkeypatch.setenv("CXX", "no-such-c++")
    layer = random_layer(4, 128, 64, 64, seed=5)
    layer.kernel = "w4a8"
    x = torch.randn(2, 128)
    with pytest.warns(RuntimeWarning, match="no C.. compiler") as caught:
        y = layer(x)
        layer(x)
    assert len(caught) == 1 and native._LIB == {"lib": None}
    assert cpu.cpu_path(x, layer) != "w4a8" and w4a8_cpu.available() == ["ref"]
    assert rel(y, x.double() @ layer.dequantize(torch.float64).t()) < 1e-6


def test_fast_head_needs_whole_words(tmp_path):
    from compress.decoder.runtime import FAST_HEAD, fast_head

    for vocab, head in ((320, FAST_HEAD), (300, "none")):
        (tmp_path / "config.json").write_text(json.dumps({"vocab_size": vocab}))
        assert fast_head(tmp_path) == head
    assert fast_head(tmp_path / "missing") == "none"


@pytest.mark.skipif(not C_PATHS, reason="the C++ kernels did not build")
def test_decoder_default_runs_the_kernel_compiled(tmp_path, capsys):
    """A quantized folder's default configuration (``FAST_KERNEL``, the int8 head, lean, compiled);
    with ``--kernel w4a8`` W4A8 layers inside the compiled step, whose greedy tokens are the
    eager W4A8 model's; ``kernel="exact"`` keeps the exact layers."""
    from compress.decoder.__main__ import main
    from compress.decoder.generate import generate
    from compress.decoder.model import load
    from compress.methods.quant.rtn import pack_model, quantization_config
    from tests.test_decoder import save, tiny_hf, tiny_tokenizer

    folder = save(
        pack_model(tiny_hf(vocab_size=320), 4, 32),
        tmp_path / "q4",
        tiny_tokenizer(),
        quantization_config(4, 32),
    )
    main([str(folder), "--prompt", "the quick brown", "--max-new-tokens", "6", "--json"])
    conf = json.loads(capsys.readouterr().out)["runtime"]
    assert (
        conf["kernel"] == FAST_KERNEL
        and conf["head"] == "int8"
        and conf["lean"]
        and conf["compile"]
    )
    main([str(folder), "--prompt", "the quick brown", "--max-new-tokens", "6", "--json",
          "--kernel", "w4a8"])  # fmt: skip
    out = json.loads(capsys.readouterr().out)
    assert out["runtime"]["kernel"] == "w4a8" and out["runtime"]["compile"]
    model, tok = load(folder, dtype=torch.bfloat16, lean=True, head="int8", kernel="w4a8")
    layers = [m for m in model.modules() if isinstance(m, QuantLinear)]
    assert len(layers) == 2 * 4 + 1  # qkv, o, gate_up, down per layer; the head
    assert all(m.kernel == "w4a8" and m.cache["lean"] == "w4a8" for m in layers)
    ids = tok("the quick brown").input_ids
    compiled = generate(model, [ids], 6, compile=True, ignore_eos=True)
    step = next(iter(model.static_steps.values()))
    assert step.compiled_calls == 5  # the compiled graph made every token after the prefill's
    assert isinstance(step.model.model.layers[0].mlp.down_proj, w4a8_cpu.W4A8Linear)
    eager = generate(model, [ids], 6, ignore_eos=True)
    assert compiled.tokens == eager.tokens
    # the CLI's text leaves out a trailing partial character
    assert out["text"].rstrip("\ufffd") == tok.decode(eager.tokens[0]).rstrip("\ufffd")
    exact, _ = load(folder, kernel="exact")
    assert all(m.kernel == "exact" for m in exact.modules() if isinstance(m, QuantLinear))


def test_a_quantized_draft_defaults_to_the_fast_configuration(tmp_path):
    """``--draft AWQ_RUN`` with no other flags: the draft loads bfloat16, lean, ``FAST_KERNEL``, with the
    fast head, and decodes compiled, whatever the (float) target runs; explicit flags win."""
    from compress.decoder.__main__ import configuration, parse_args
    from compress.decoder.runtime import RuntimeConfig
    from compress.decoder.speculative.cli import draft_runtime

    target, draft = tmp_path / "fp", tmp_path / "q4"
    for folder, qcfg in ((target, None), (draft, {"quant_method": "awq", "bits": 4})):
        folder.mkdir()
        (folder / "config.json").write_text(
            json.dumps({"vocab_size": 320, "quantization_config": qcfg})
        )

    def runtimes(*flags):
        args = parse_args(
            [str(target), "--prompt", "x", "--device", "cpu", "--draft", str(draft), *flags]
        )
        conf = configuration(args)
        args.compile_flag, args.compile = args.compile, conf.compile
        return conf, draft_runtime(args, conf)

    conf, kw = runtimes()
    assert conf.dtype == "float32" and conf.kernel == "exact" and not conf.compile
    assert kw == RuntimeConfig(dtype="bfloat16", qdtype="bfloat16", lean=True, kernel=FAST_KERNEL,
                               head="int8", compile=True, fast=True)  # fmt: skip
    _, kw = runtimes("--no-compile", "--kernel", "w4a8", "--no-lean")
    assert not kw.compile and kw.kernel == "w4a8" and not kw.lean
    _, kw = runtimes("--dtype", "float32")  # the bit-faithful path, for the draft as the target
    assert kw == RuntimeConfig(dtype="float32", qdtype="float32")
    _, kw = runtimes("--dtype", "bfloat16")  # naming one setting keeps the fast choice for the rest
    assert kw.kernel == FAST_KERNEL and kw.head == "int8" and kw.compile and kw.lean


@pytest.mark.slow
@pytest.mark.skipif(not C_PATHS, reason="the C++ kernels did not build")
def test_quantized_draft_default_is_exact(tmp_path, capsys):
    """``--draft Q4`` with no other flags: the draft runs its fast configuration (lean, compiled);
    the output is the float target's own greedy text."""
    from compress.decoder.__main__ import main
    from compress.methods.quant.rtn import pack_model, quantization_config
    from tests.test_decoder import save, tiny_hf, tiny_tokenizer

    tok = tiny_tokenizer()
    target = save(tiny_hf(vocab_size=320), tmp_path / "fp", tok)
    draft = save(pack_model(tiny_hf(vocab_size=320), 4, 32), tmp_path / "q4", tok,
                 quantization_config(4, 32))  # fmt: skip
    base = [str(target), "--prompt", "the quick brown", "--max-new-tokens", "16", "--json"]
    main(base)
    plain = json.loads(capsys.readouterr().out)
    main(base + ["--draft", str(draft)])
    out = json.loads(capsys.readouterr().out)
    assert out["text"] == plain["text"] and out["acceptance"] > 0
    assert out["draft_runtime"] == dict(device="cpu", dtype="bfloat16", qdtype="bfloat16",
                                        kernel=FAST_KERNEL, head="int8", lean=True, compile=True,
                                        batch_invariant=False, threads=None, fast=True)  # fmt: skip


@pytest.mark.skipif(not C_PATHS, reason="the C++ kernels did not build")
@pytest.mark.parametrize("path", C_PATHS)
@pytest.mark.parametrize("bits", [3, 4])
@pytest.mark.parametrize("symmetric", [False, True])
def test_experts_match_float64_reference(path, bits, symmetric):
    """``w4a8_experts`` (every routed expert's two projections in one call) on every path: rows
    routed to overlapping experts (an expert read once for several rows), into a poisoned output,
    against the float64 reference of the same arithmetic; the operator equals the ctypes call
    bit for bit and returns the input's dtype."""
    E, H, inter, k = 5, 96, 128, 3
    gate_up = [random_layer(bits, H, 2 * inter, 32, 10 * bits + i, symmetric) for i in range(E)]
    down = [random_layer(bits, inter, H, 64, 100 + 10 * bits + i, symmetric) for i in range(E)]
    lib, which = native.library(), w4a8_cpu.PATHS[path]
    for M in (1, 2, 4):
        gen = torch.Generator().manual_seed(M)
        x = torch.randn(M, H, generator=gen) * (1 + 3 * torch.rand(M, H, generator=gen))
        e = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(M)])
        w = torch.rand(M, k, generator=gen)
        ref = w4a8_ref.experts(x, w, e, gate_up, down)
        y = torch.full((M, H), math.nan)
        forms = [w4a8_cpu.form(m) for m in gate_up], [w4a8_cpu.form(m) for m in down]
        ptrs = [w4a8_cpu._pointers(ts) for f in forms for ts in zip(*f)]
        lib.w4a8_experts(
            x.data_ptr(), e.data_ptr(), w.data_ptr(), M, k, H, inter,
            *ptrs[:3], 32, bits, symmetric, *ptrs[3:], 64, bits, symmetric, y.data_ptr(), which, 2,
        )  # fmt: skip
        assert torch.isfinite(y).all() and rel(y, ref) < 2e-6, (M, rel(y, ref))
        experts = w4a8_cpu.Experts(gate_up, down)
        # the stacked forms hold what each expert's own form held, and the layers now view them
        for j, layers in ((0, gate_up), (3, down)):
            for i, m in enumerate(layers):
                for f, own, now in zip(
                    experts.forms[j : j + 3], forms[j // 3][i], w4a8_cpu.form(m)
                ):
                    assert torch.equal(f[i], own) and now.data_ptr() == f[i].data_ptr()
                if symmetric:  # fp16 scales the layer held itself are held once, in the stack
                    assert m.scales.data_ptr() == experts.forms[j + 1][i].data_ptr()
        for dtype in (torch.float32, torch.bfloat16):
            out = experts(x.to(dtype), w, e, path)
            assert out.dtype == dtype
            want = w4a8_cpu._ctypes_experts(
                x.to(dtype), w, e, *experts.forms, bits, 32, bits, 64, which
            )
            assert torch.equal(out, want), (M, dtype)
            if dtype == torch.float32:
                assert torch.equal(out, y)


@pytest.mark.skipif(not C_PATHS, reason="the C++ kernels did not build")
def test_lean_experts_still_run_one_by_one_after_stacking():
    """Lean experts (``keep_w4a8_only``: the packed codes freed) whose forms were stacked for the
    one-call kernel, their fp16 scales moved into the stack, still compute through their own
    layers (prefill's path) as before, and hold their scales once."""
    E, H, inter = 3, 64, 96
    gate_up = [random_layer(4, H, 2 * inter, 32, 7 + i, symmetric=True) for i in range(E)]
    down = [random_layer(4, inter, H, 32, 70 + i, symmetric=True) for i in range(E)]
    x = torch.randn(5, H, generator=torch.Generator().manual_seed(3))
    for m in gate_up:
        m.kernel = "w4a8"
        cpu.keep_w4a8_only(m)
    before = [m(x) for m in gate_up]
    w4a8_cpu.Experts(gate_up, down)
    for m, want in zip(gate_up, before):
        assert torch.equal(m(x), want)
        assert m.scales.data_ptr() == w4a8_cpu.form(m)[1].data_ptr()


def test_experts_with_mixed_scale_forms_are_not_one_call():
    """Experts whose layers hold different forms of the scales (an asymmetric layer whose zero
    points happen to be equal takes the fp16 form) are not given to the one-call kernel, which
    reads one form per projection; the decoder then runs them expert by expert."""
    sym = random_layer(4, 64, 64, 32, 2, symmetric=True)
    asym = random_layer(4, 64, 64, 32, 1)
    assert not w4a8_cpu.Experts([asym, sym], [asym, asym]).uniform
    assert w4a8_cpu.Experts([sym, sym], [asym, asym]).uniform
