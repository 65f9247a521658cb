"""PackKV's greedy token order: the C++ kernel and the PyTorch reference against a plain-Python
statement of the rule, on fresh random codes."""

import pytest
import torch

from compress import kernels
from compress.kernels import native, packkv_cpu, packkv_ref


def greedy_python(codes: torch.Tensor, pack: int = 16) -> list[list[int]]:
    """The rule of ``packkv_ref.order_greedy`` in plain Python integers, one block row at a time."""
    out = []
    for row in codes.tolist():
        T, C = len(row), len(row[0])
        left, order = list(range(T)), []
        for s in range(T):
            if s % pack == 0:
                pick = min(left, key=lambda t: (sorted(row[t])[(C - 1) // 2], t))
                lo, hi = list(row[pick]), list(row[pick])
            else:

                def key(t, lo=lo, hi=hi, row=row):
                    span = [max(h, x) - min(m, x) for m, h, x in zip(lo, hi, row[t])]
                    return (sum(s.bit_length() for s in span), sum(span), t)

                pick = min(left, key=key)
                lo = [min(a, b) for a, b in zip(lo, row[pick])]
                hi = [max(a, b) for a, b in zip(hi, row[pick])]
            left.remove(pick)
            order.append(pick)
        out.append(order)
    return out


def codes_of(n, t, c, top, seed):
    """Random codes with a few repeated tokens (ties) and channels of different ranges."""
    g = torch.Generator().manual_seed(seed)
    hi = torch.randint(0, top + 1, (n, 1, c), generator=g)
    x = (torch.rand(n, t, c, generator=g) * (hi + 1)).to(torch.uint8)
    x[:, 3] = x[:, 1]  # an exact tie: the first of equal keys wins
    return x


CASES = [(3, 32, 40, 12, 1), (2, 48, 70, 255, 2), (2, 32, 128, 30, 3), (1, 16, 5, 3, 4)]


@pytest.mark.parametrize("n,t,c,top,seed", CASES)
def test_reference_follows_the_rule(n, t, c, top, seed):
    x = codes_of(n, t, c, top, seed)
    assert packkv_ref.order_greedy(x).tolist() == greedy_python(x)


@pytest.fixture
def built():
    if native.library() is None:
        pytest.fail("the C++ CPU kernels did not build on this machine (see the warning)")


@pytest.mark.parametrize("n,t,c,top,seed", CASES)
@pytest.mark.parametrize("threads", [1, 2])
def test_cpp_equals_the_reference(built, n, t, c, top, seed, threads):
    """C (70, 40, 5) not a multiple of 32 runs the scalar tail after the vector loop."""
    x = codes_of(n, t, c, top, seed + 10)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        perm = packkv_cpu.order_greedy(x)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(perm, packkv_ref.order_greedy(x))
    assert torch.equal(perm.sort(-1).values, torch.arange(t).expand(n, t))


def test_portable_build_equals_the_reference(built, monkeypatch):
    """The build without vector instructions (what a CPU without AVX2 gets)."""
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        pytest.skip("this CPU runs the portable build in every other test")
    lib = native._build("DEFAULT")
    assert lib.cpu_simd_bits() == 0
    monkeypatch.setattr(native, "_LIB", {"lib": lib})
    x = codes_of(3, 64, 128, 40, 7)
    assert torch.equal(packkv_cpu.order_greedy(x), packkv_ref.order_greedy(x))


def test_dispatch(built, monkeypatch):
    x = codes_of(2, 32, 64, 20, 5)
    calls = []
    monkeypatch.setattr(packkv_cpu, "order_greedy", lambda c: calls.append(1) or "cpp")
    monkeypatch.delenv("COMPRESS_KERNELS", raising=False)
    assert kernels.packkv_order(x) == "cpp"
    for forced in ("ref", "eager"):
        monkeypatch.setenv("COMPRESS_KERNELS", forced)
        assert torch.equal(kernels.packkv_order(x), packkv_ref.order_greedy(x))
    monkeypatch.setattr(native, "_LIB", {"lib": None})  # no compiler: the reference
    monkeypatch.delenv("COMPRESS_KERNELS")
    assert torch.equal(kernels.packkv_order(x), packkv_ref.order_greedy(x))
    assert calls == [1]
