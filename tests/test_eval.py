"""Perplexity, KL and top-1 against float64 math written from the definitions; the source cache."""

import math

import torch

from compress.eval.perplexity import evaluate
from tests.conftest import make_tiny_model


def reference(model, source, windows):
    nll, kl, agree, n = 0.0, 0.0, 0, 0
    with torch.no_grad():
        for w in windows:
            q = torch.softmax(model(w[None]).logits[0, :-1].double(), -1)
            p = torch.softmax(source(w[None]).logits[0, :-1].double(), -1)
            for t in range(w.numel() - 1):
                nll -= math.log(q[t, w[t + 1]].item())
                kl += (p[t] * (p[t].log() - q[t].log())).sum().item()
                agree += int(p[t].argmax() == q[t].argmax())
                n += 1
    return math.exp(nll / n), kl / n, agree / n


def test_figures_match_definitions(tmp_path):
    model, source = make_tiny_model(seed=1), make_tiny_model(seed=2)
    windows = torch.randint(0, 49152, (2, 24), generator=torch.Generator().manual_seed(0))
    ppl, kl, top1 = reference(model, source, windows)
    got = evaluate(model, windows, source)
    assert math.isclose(got["ppl"], ppl, rel_tol=1e-5)
    assert math.isclose(got["kl_vs_source"], kl, rel_tol=1e-4)
    assert math.isclose(got["top1_vs_source"], top1, rel_tol=1e-9)
    assert got["ppl_windows"] == 2 and got["seqlen"] == 24
    source_ppl = reference(source, source, windows)[0]
    assert math.isclose(got["source_ppl"], source_ppl, rel_tol=1e-5)

    # the cache stores what the source adds once (a window an entry) and gives the same figures
    first = evaluate(model, windows, source, cache=tmp_path, source_sha="abc")
    assert len(list(tmp_path.glob("*.safetensors"))) == 2
    other = make_tiny_model(seed=3)
    second = evaluate(model, windows, other, cache=tmp_path, source_sha="abc")
    # read from the cache, not the other model
    assert math.isclose(first["kl_vs_source"], second["kl_vs_source"], rel_tol=1e-6)
    assert not math.isclose(evaluate(model, windows, other)["kl_vs_source"], kl, rel_tol=1e-5)
    assert math.isclose(first["kl_vs_source"], kl, rel_tol=1e-4)
    assert math.isclose(second["source_ppl"], source_ppl, rel_tol=1e-5)  # from the cache
