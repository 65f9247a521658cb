"""Fused dequant-matmul kernels against a float64 reference decoded from the packed-format spec.

The Triton kernels run on the CPU through Triton's interpreter: TRITON_INTERPRET
must be set before the module that defines them is imported.
"""

import os
import subprocess
import sys
import textwrap

os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

from compress.errors import CompressError  # noqa: E402
from compress.formats.quantizer import quantize  # noqa: E402
from compress.kernels import cpu, quant_matmul  # noqa: E402
from compress.kernels.dequant_matmul import gemv, triton_quant_matmul  # noqa: E402
from compress.kernels.dequant_matmul_ref import dequant_matmul_ref, dequantize_ref  # noqa: E402
from compress.layers import QuantLinear  # noqa: E402


def make_layer(bits: int, k: int, n: int, g: int, seed: int) -> QuantLinear:
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed))
    return QuantLinear.from_quantized(quantize(w, bits, g))


def make_input(m: int, k: int, seed: int, dtype=torch.float32) -> torch.Tensor:
    return torch.randn(m, k, generator=torch.Generator().manual_seed(seed + 1)).to(dtype)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert not torch.isnan(out).any(), "output has unwritten (NaN) entries"
    assert ref.abs().max() > 0
    return ((out.double() - ref).norm() / ref.norm()).item()


# ---- the reference itself -----------------------------------------------------------------------


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 7, 8])
def test_reference_decodes_what_the_quantizer_encoded(bits):
    w = torch.randn(64, 128, generator=torch.Generator().manual_seed(bits))
    qw = quantize(w, bits, 32)
    layer = QuantLinear.from_quantized(qw)
    assert torch.equal(dequantize_ref(layer), qw.dequantize(torch.float64))


# ---- Triton (interpreted) -----------------------------------------------------------------------

TRITON_CASES = [  # bits, M, K, N, group
    (4, 1, 256, 96, 64),
    (4, 3, 128, 64, 32),
    (4, 8, 384, 160, 128),
    (4, 17, 256, 72, 64),
    (4, 64, 128, 128, 32),
    (3, 1, 256, 96, 128),
    (3, 7, 128, 64, 32),
    (3, 17, 384, 160, 128),
    (3, 64, 256, 64, 64),
    (8, 1, 128, 64, 32),
    (8, 8, 256, 96, 64),
    (8, 17, 256, 128, 128),
    (2, 3, 256, 64, 64),
    (5, 17, 128, 96, 32),
    (7, 1, 256, 64, 128),
]


@pytest.mark.parametrize("bits,m,k,n,g", TRITON_CASES)
def test_triton_matches_reference(bits, m, k, n, g):
    seed = hash((bits, m, k, n, g)) % 2**31
    layer = make_layer(bits, k, n, g, seed)
    x = make_input(m, k, seed)
    out = torch.full((m, n), float("nan"))
    assert triton_quant_matmul(x, layer, out) is out
    assert rel_err(out, dequant_matmul_ref(x, layer)) < 1e-5  # fp32 accumulation, "ieee" tl.dot


@pytest.mark.parametrize("bits,split_k", [(4, 2), (3, 3), (8, 8)])
def test_triton_gemv_split_k(bits, split_k):
    layer = make_layer(bits, 512, 96 if bits == 4 else 64, 64, seed=split_k)
    x = make_input(5, 512, seed=split_k)
    out = torch.full((5, layer.out_features), float("nan"))
    gemv(x, layer, out, split_k=split_k)
    assert rel_err(out, dequant_matmul_ref(x, layer)) < 1e-5


def test_triton_half_inputs():
    layer = make_layer(4, 256, 64, 64, seed=3)
    for m in (2, 17):
        x = make_input(m, 256, seed=m, dtype=torch.float16)
        out = torch.full((m, 64), float("nan"), dtype=torch.float16)
        triton_quant_matmul(x, layer, out)
        assert rel_err(out, dequant_matmul_ref(x, layer)) < 1e-2


# Compiles the kernels for an H100/H200 (sm_90) without a GPU: Triton's front end and ptxas
# reject things the interpreter lets through. Needs a process without TRITON_INTERPRET.
AOT_SCRIPT = textwrap.dedent("""
    import torch
    from triton.backends.compiler import GPUTarget
    from triton.runtime.driver import driver

    class NoGPU:  # what JITFunction.warmup asks of the driver
        def get_current_device(self): return 0
        def get_current_stream(self, device=None): return 0
        def get_current_target(self): return GPUTarget("cuda", 90, 32)
    driver.set_active(NoGPU())

    from compress.kernels import dequant_matmul as dm
    from compress.layers import QuantLinear
    from compress.formats.quantizer import quantize

    for bits in (4, 3):
        layer = QuantLinear.from_quantized(quantize(torch.randn(256, 256), bits, 128))
        qw, qz, meta = dm._launch_args(layer)
        x, out = torch.randn(4, 256, dtype=torch.bfloat16), torch.empty(4, 256, dtype=torch.bfloat16)
        gemm = dm._gemm_kernel.warmup(x, out, qw, qz, layer.scales, 4, 256, 256, 256, grid=(1, 1),
                                      BLOCK_M=64, BLOCK_N=64, BLOCK_K=64, **meta)
        gemv = [dm._gemv_kernel.warmup(x, out, qw, qz, layer.scales, m, 256, 256, 256, 256, grid=(1, 1),
                                       BLOCK_M=m, BLOCK_N=64, BLOCK_K=32, **meta) for m in (1, 4)]
        assert gemm.asm["cubin"] and all(k.asm["cubin"] for k in gemv)
    print("compiled")
""")


def test_triton_kernels_compile_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run(
        [sys.executable, "-c", AOT_SCRIPT], env=env, capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0 and "compiled" in run.stdout, run.stderr[-3000:]


# ---- CPU paths ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "bits,m,k,n,g",
    [
        (4, 1, 256, 96, 64),
        (4, 7, 128, 64, 32),
        (4, 17, 256, 64, 128),
        (3, 1, 256, 64, 128),
        (3, 8, 128, 64, 32),
        (3, 64, 256, 96, 64),
        (8, 3, 256, 64, 64),
        (8, 17, 128, 64, 32),
        (2, 1, 128, 64, 32),
        (6, 7, 128, 64, 64),
    ],
)
def test_cpu_fp32_matches_reference(bits, m, k, n, g, monkeypatch):
    """The float32 path (K-packed planes) is exact up to fp32 rounding; eager here, compiled below."""
    monkeypatch.setenv("COMPRESS_KERNELS", "eager")
    seed = hash((bits, m, k, n, g)) % 2**31
    layer = make_layer(bits, k, n, g, seed)
    x = make_input(m, k, seed)
    assert rel_err(cpu.cpu_quant_matmul(x, layer), dequant_matmul_ref(x, layer)) < 1e-5


@pytest.mark.parametrize("bits,m", [(4, 1), (3, 3), (8, 1), (3, 17)])
def test_cpu_fp32_compiled_matches_reference(bits, m):
    layer = make_layer(bits, 256, 256, 64, seed=bits)
    assert layer.in_features * layer.out_features >= cpu.COMPILE_MIN_WEIGHTS
    x = make_input(m, 256, seed=m)
    assert cpu.cpu_path(x, layer) == ("kplanes-gemv" if m <= cpu.GEMV_MAX_M else "kplanes-dequant")
    assert rel_err(cpu.cpu_quant_matmul(x, layer), dequant_matmul_ref(x, layer)) < 1e-5
    assert not (cpu.gemv_compiled.failed or cpu.dequant_compiled.failed), (
        "torch.compile fell back to eager"
    )


@pytest.mark.parametrize(
    "bits,m,k,n,g",
    [
        (4, 1, 256, 96, 64),
        (4, 17, 128, 64, 32),
        (3, 1, 256, 64, 128),
        (3, 8, 128, 64, 32),
        (2, 3, 128, 64, 32),
        (8, 1, 256, 64, 64),
        (8, 64, 128, 64, 32),
        (5, 7, 128, 64, 64),
    ],
)
def test_cpu_bf16_int4pack_matches_reference(bits, m, k, n, g):
    seed = hash((bits, m, k, n, g)) % 2**31
    layer = make_layer(bits, k, n, g, seed)
    x = make_input(m, k, seed, dtype=torch.bfloat16)
    assert cpu.int4pack_fits(x, layer)
    # bfloat16 output and bfloat16 scales: about 2^-9 relative
    assert rel_err(cpu.int4pack_mm(x, layer), dequant_matmul_ref(x, layer)) < 1e-2


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cpu_half_inputs_match_reference(dtype, monkeypatch):
    monkeypatch.setenv("COMPRESS_KERNELS", "eager")
    layer = make_layer(4, 128, 64, 32, seed=5)
    for m in (2, cpu.INT4PACK_MAX_M[1] + 1):
        x = make_input(m, 128, seed=m, dtype=dtype)
        assert cpu.cpu_path(x, layer) != "reference"
        assert rel_err(cpu.cpu_quant_matmul(x, layer), dequant_matmul_ref(x, layer)) < 1e-2


def test_cpu_cache_follows_new_weights(monkeypatch):
    monkeypatch.setenv("COMPRESS_KERNELS", "eager")
    layer, other = make_layer(4, 128, 64, 32, seed=1), make_layer(4, 128, 64, 32, seed=2)
    x = make_input(2, 128, seed=1)
    for dtype in (torch.float32, torch.bfloat16):
        quant_matmul(x.to(dtype), layer)  # fills layer.cache
    layer.load_state_dict(other.state_dict())
    assert rel_err(quant_matmul(x, layer), dequant_matmul_ref(x, other)) < 1e-5
    assert (
        rel_err(quant_matmul(x.bfloat16(), layer), dequant_matmul_ref(x.bfloat16(), other)) < 1e-2
    )


def test_cpu_prefill_buffer_shared_by_layers(monkeypatch):
    monkeypatch.setenv("COMPRESS_KERNELS", "eager")
    big, small = make_layer(4, 256, 128, 64, seed=1), make_layer(3, 128, 64, 32, seed=2)
    for layer in (small, big, small, big):  # the buffer grows, then serves both
        x = make_input(cpu.GEMV_MAX_M + 1, layer.in_features, seed=layer.bits)
        assert cpu.cpu_path(x, layer) == "kplanes-dequant"
        assert rel_err(cpu.cpu_quant_matmul(x, layer), dequant_matmul_ref(x, layer)) < 1e-5


def test_quant_linear_forward_and_forced_reference(monkeypatch):
    monkeypatch.setenv("COMPRESS_KERNELS", "eager")
    layer = make_layer(3, 128, 64, 32, seed=7)
    layer.bias = torch.randn(64, generator=torch.Generator().manual_seed(7))
    x = make_input(6, 128, seed=7).reshape(2, 3, 128)
    ref = dequant_matmul_ref(x.reshape(6, 128), layer).reshape(2, 3, 64) + layer.bias.double()
    assert rel_err(layer(x), ref) < 1e-5
    monkeypatch.setenv("COMPRESS_KERNELS", "ref")
    assert rel_err(layer(x), ref) < 1e-5
    monkeypatch.delenv("COMPRESS_KERNELS")
    assert layer(x[:0]).shape == (0, 3, 64)


@pytest.mark.parametrize(
    "bits,dtype,tol",
    [
        (4, torch.bfloat16, 1e-2),
        (8, torch.bfloat16, 1e-2),
        (4, torch.float32, 1e-5),
        (3, torch.float32, 1e-5),
    ],
)
def test_cpu_linear_modules_match_reference(bits, dtype, tol):
    """The modules the compiled decode step holds compute ``x W_hat^T + b`` on [B, T, in] inputs."""
    layer = make_layer(bits, 256, 64, 64, seed=bits)
    layer.bias = torch.randn(64, generator=torch.Generator().manual_seed(bits))
    x = make_input(6, 256, seed=bits, dtype=dtype).reshape(2, 3, 256)
    ref = dequant_matmul_ref(x.reshape(6, 256), layer).reshape(2, 3, 64) + layer.bias.double()
    if dtype == torch.bfloat16:
        module = cpu.Int4PackLinear(layer, dtype)
        assert module.parts == (1 if bits <= 4 else 2)
    else:
        module = cpu.KPlanesLinear(layer, cpu.gemv_unroll(layer, 6))
    y = module(x)
    assert y.dtype == dtype and y.shape == (2, 3, 64)
    assert rel_err(y, ref) < tol
    assert torch.equal(cpu.Eager(layer)(x), layer(x))


# ---- shapes the kernels cannot take --------------------------------------------------------------


def test_error_in_features_not_multiple_of_group():
    layer = QuantLinear(100, 64, 4, 32)
    with pytest.raises(
        CompressError, match=r"in_features 100 is not a multiple of the group size 32"
    ):
        quant_matmul(torch.randn(1, 100), layer)


def test_error_out_features_not_multiple_of_packing():
    layer = QuantLinear(128, 60, 4, 32)
    with pytest.raises(CompressError, match=r"out_features 60 is not a multiple of 8"):
        quant_matmul(torch.randn(1, 128), layer)


def test_error_group_not_multiple_of_k_block(monkeypatch):
    monkeypatch.setenv("COMPRESS_KERNELS", "eager")
    layer = make_layer(4, 96, 64, 24, seed=0)
    x = make_input(1, 96, seed=0)
    with pytest.raises(CompressError, match=r"group size 24 is not a multiple of 16"):
        triton_quant_matmul(x, layer)
    assert (
        rel_err(quant_matmul(x, layer), dequant_matmul_ref(x, layer)) < 1e-5
    )  # the CPU path takes it


def test_error_wrong_dtypes_and_shapes():
    layer = make_layer(4, 128, 64, 32, seed=0)
    with pytest.raises(CompressError, match=r"input dtype torch.int64"):
        quant_matmul(torch.ones(1, 128, dtype=torch.long), layer)
    with pytest.raises(CompressError, match=r"input of shape \(1, 64\) is not \[M, 128\]"):
        quant_matmul(torch.randn(1, 64), layer)
    layer.qweight = layer.qweight.to(torch.int64)
    with pytest.raises(CompressError, match=r"qweight has shape \(128, 8\), dtype torch.int64"):
        quant_matmul(torch.randn(1, 128), layer)
