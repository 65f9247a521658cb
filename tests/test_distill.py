"""Distillation losses, the trainer's schedule, data order, checkpoints and refusals (in-process)."""

import pytest
import torch

from compress.errors import CompressError
from compress.methods.distill.distill import (
    ce_loss,
    check_vocab,
    distill_loss,
    kl_loss,
    run_distill,
)
from compress.methods.distill.trainer import Sampler, TrainConfig, latest_checkpoint, lr_factor
from tests.conftest import make_tiny_model

SMALL = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2)


def test_kl_loss_matches_float64_reference():
    g = torch.Generator().manual_seed(0)
    zs, zt = torch.randn(2, 5, 11, generator=g) * 3, torch.randn(2, 5, 11, generator=g) * 3
    for T in (1.0, 2.0):
        p = torch.exp(zt.double() / T) / torch.exp(zt.double() / T).sum(-1, keepdim=True)
        q = torch.exp(zs.double() / T) / torch.exp(zs.double() / T).sum(-1, keepdim=True)
        ref = T * T * (p * (p.log() - q.log())).sum(-1).mean()
        assert abs(kl_loss(zs, zt, T).item() - ref.item()) < 1e-6 * max(1.0, ref.item())
    assert kl_loss(zs, zs).abs().item() < 1e-6


def test_ce_and_mix_losses():
    teacher, student = make_tiny_model(seed=0, **SMALL), make_tiny_model(seed=1, **SMALL)
    x = torch.randint(0, 49152, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        zs, zt = student(x).logits[:, :-1], teacher(x).logits[:, :-1]
        ref_ce = -torch.log_softmax(zs.double(), -1).gather(-1, x[:, 1:, None]).mean()
        assert abs(ce_loss(zs, x[:, 1:]).item() - ref_ce.item()) < 1e-5
        kl, ce = kl_loss(zs, zt).item(), ce_loss(zs, x[:, 1:]).item()
        assert abs(distill_loss(teacher, "kl")(student, x).item() - kl) < 1e-6
        assert abs(distill_loss(None, "ce")(student, x).item() - ce) < 1e-6
        mix = distill_loss(teacher, "mix", alpha=0.3)(student, x).item()
        assert abs(mix - (0.3 * kl + 0.7 * ce)) < 1e-5
    with pytest.raises(CompressError, match="kl, ce, mix"):
        distill_loss(teacher, "mse")


def test_error_vocab_mismatch():
    with pytest.raises(CompressError, match="different vocabularies.*49152 and 1000"):
        check_vocab(make_tiny_model(vocab_size=1000, **SMALL), make_tiny_model(**SMALL))


def test_lr_schedule_warmup_then_cosine():
    f = [lr_factor(s, 10, 2, 0.1) for s in range(10)]
    assert f[:2] == [0.5, 1.0]
    assert all(a >= b for a, b in zip(f[1:], f[2:]))  # non-increasing after warm-up
    assert abs(f[2] - 1.0) < 1e-12 and abs(lr_factor(10, 10, 2, 0.1) - 0.1) < 1e-12
    mid = lr_factor(6, 10, 2, 0.1)  # half-way through the decay: the mean of peak and floor
    assert abs(mid - 0.55) < 1e-12


def test_sampler_is_a_permutation_per_pass_and_deterministic():
    s = Sampler(7, seed=3)
    first = s(torch.arange(14))
    assert sorted(first[:7].tolist()) == list(range(7)) and sorted(first[7:].tolist()) == list(
        range(7)
    )
    assert not torch.equal(first[:7], first[7:])  # a new order each pass
    assert torch.equal(Sampler(7, seed=3)(torch.arange(5, 12)), first[5:12])  # depends on g alone


def _run(tmp_path, lr=1e-3, tokens=6 * 16, **kw):
    teacher, student = make_tiny_model(seed=0, **SMALL), make_tiny_model(seed=1, **SMALL)
    blocks = torch.randint(0, 49152, (5, 16), generator=torch.Generator().manual_seed(0))
    tc = TrainConfig(
        tokens=tokens,
        seqlen=16,
        batch_size=1,
        grad_accum=1,
        lr=lr,
        progress=False,
        checkpoint_dir=str(tmp_path / "ckpt"),
        **kw,
    )
    stats = run_distill(student, teacher, blocks, tc, "kl", 1.0, 0.5, {"recipe": "test"})
    return student, stats


def test_training_lowers_the_loss_and_cleans_up(tmp_path):
    student, stats = _run(tmp_path, tokens=12 * 16, checkpoint_every=4)
    assert stats["steps"] == 12 and stats["tokens"] == 12 * 16 and len(stats["losses"]) == 12
    assert stats["losses"][-1] < stats["losses"][0]
    assert not (tmp_path / "ckpt").exists()  # removed once training completed
    assert not student.training


def test_zero_tokens_skips_training(tmp_path):
    student, stats = _run(tmp_path, tokens=0)
    assert stats["steps"] == 0 and stats["tokens"] == 0
    assert torch.equal(
        student.model.embed_tokens.weight,
        make_tiny_model(seed=1, **SMALL).model.embed_tokens.weight,
    )


def test_error_resume_from_other_settings(tmp_path):
    _run(tmp_path, checkpoint_every=2, keep_checkpoints=True)
    found = latest_checkpoint(tmp_path / "ckpt")
    assert found.name == "step-00000004"  # the last one before the end
    assert sorted(p.name for p in found.iterdir()) == [
        "model.safetensors",
        "optimizer.pt",
        "rng-0.pt",
        "scheduler.pt",
        "state.json",
    ]
    with pytest.raises(
        CompressError, match=r"belongs to another run \(lr: 0.001 in the checkpoint, 0.002 now\)"
    ):
        _run(tmp_path, lr=2e-3, checkpoint_every=2)
