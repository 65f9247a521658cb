"""The chunked distillation loss equals the whole-logits loss, value and gradients; the batch
planner and the time budget."""

import pytest
import torch

from compress.errors import CompressError
from compress.methods.distill.distill import distill_loss, resolve_chunk
from compress.methods.distill.trainer import TrainConfig, plan_batch
from tests.conftest import make_tiny_model

SMALL = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2)


@pytest.mark.parametrize("kind", ["kl", "ce", "mix"])
def test_chunked_loss_equals_whole_logits(kind):
    """Chunks of 7 tokens (not dividing the 2 x 11 predicted positions) give the loss and the
    student's gradients of the whole-logits loss (float64 models: rounding apart, exact)."""
    teacher = make_tiny_model(seed=0, **SMALL).double()
    x = torch.randint(0, 49152, (2, 12), generator=torch.Generator().manual_seed(0))
    grads, values = [], []
    for chunk in (0, 7):
        student = make_tiny_model(seed=1, **SMALL).double().train()
        loss = distill_loss(teacher if kind != "ce" else None, kind, 2.0, 0.3, chunk)(student, x)
        loss.backward()
        values.append(loss.item())
        grads.append({n: p.grad.clone() for n, p in student.named_parameters()})
    assert values[1] == pytest.approx(values[0], rel=1e-12)
    for n in grads[0]:
        torch.testing.assert_close(grads[1][n], grads[0][n], rtol=1e-9, atol=1e-12)


def test_chunk_and_batch_settings():
    assert resolve_chunk("auto", "cpu") == 0 and resolve_chunk("auto", "cuda") == 4096
    assert resolve_chunk(512, "cpu") == 512
    with pytest.raises(CompressError, match="kl_chunk"):
        resolve_chunk(-1, "cpu")
    tc = TrainConfig(tokens=10_000, seqlen=64, batch_size=2, grad_accum=1, tokens_per_step=1000)
    planned = plan_batch(tc, 2, "cpu")
    assert planned.grad_accum == 4  # ceil(1000 / (64 * 2 * 2))
    auto = TrainConfig(tokens=10_000, seqlen=64, batch_size=2, grad_accum=3, tokens_per_step="auto")
    assert plan_batch(auto, 1, "cpu") == auto  # the CPU keeps the given batch
    with pytest.raises(CompressError, match="tokens_per_step"):
        plan_batch(TrainConfig(tokens=1, tokens_per_step=-5), 1, "cpu")
