"""``distill.tokens_per_step=auto`` sizes the micro-batch from the device memory left once the
student, its gradients and AdamW's two moments are in place (``compress.methods.distill.trainer``), checked
on the CPU with a fake CUDA memory query."""

import pytest
import torch

from compress.errors import CompressError
from compress.methods.distill.trainer import TrainConfig, plan_batch, training_bytes
from tests.conftest import make_tiny_model

SMALL = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2)
GPU = torch.device("cuda", 0)  # only named: nothing is allocated there


def nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


@pytest.fixture
def student():
    return make_tiny_model(**SMALL).train()


def fake_free(monkeypatch, free: int) -> None:
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free, 80 * 2**30))


def per_seq(model, seqlen: int) -> int:
    return seqlen * model.config.num_hidden_layers * model.config.hidden_size * 34


def test_training_bytes_counts_weights_gradients_and_both_moments(student):
    """Not yet on the device: weights and buffers once, then gradient + exp_avg + exp_avg_sq per
    trainable parameter (a tied head once); already there: only the three; frozen: nothing."""
    params = list(student.parameters())
    assert student.lm_head.weight is student.model.embed_tokens.weight  # tied: one tensor
    weights = nbytes(params) + nbytes(student.buffers())
    assert training_bytes(student, GPU) == weights + 3 * nbytes(params)
    assert training_bytes(student, GPU, world=2) == weights + 4 * nbytes(params)  # DDP's buckets
    assert training_bytes(student, "cpu") == 3 * nbytes(params)  # in place already
    student.model.embed_tokens.requires_grad_(False)
    trainable = [p for p in params if p.requires_grad]
    assert training_bytes(student, "cpu") == 3 * nbytes(trainable)
    half = make_tiny_model(**SMALL).to(torch.bfloat16)
    assert training_bytes(half, "cpu") == 3 * nbytes(params) // 2  # moments in the param dtype


def test_auto_batch_subtracts_the_student(student, monkeypatch):
    """Free memory = the student's footprint + room for 3 sequences' activations (at half the
    rest): batch 3. Sized on the free memory alone it would be the cap of 64."""
    tc = TrainConfig(tokens=10**6, seqlen=64, tokens_per_step="auto")
    need, seq = training_bytes(student, GPU), per_seq(student, 64)
    assert need > 64 * 2 * seq  # the footprint alone would have bought the cap
    fake_free(monkeypatch, need + 2 * 3 * seq + seq // 2)
    planned = plan_batch(tc, 1, GPU, student)
    assert planned.batch_size == 3
    assert planned.grad_accum == round(min(2**19, 10**6 // 64) / (64 * 3))


def test_auto_batch_refuses_a_student_that_does_not_fit(student, monkeypatch):
    tc = TrainConfig(tokens=10**6, seqlen=64, tokens_per_step="auto")
    fake_free(monkeypatch, training_bytes(student, GPU))
    with pytest.raises(CompressError, match="weights, gradients and AdamW state.*--use_fsdp"):
        plan_batch(tc, 1, GPU, student)
    fake_free(monkeypatch, training_bytes(student, GPU) + 1)
    assert plan_batch(tc, 1, GPU, student).batch_size == 1  # fits, with room for no more


def test_fsdp_sizing_is_per_rank(student, monkeypatch):
    """Under FSDP a rank holds 1/world of the weights, gradients and moments, plus the unsharded
    root (embeddings, norm; the tied head) and two decoder layers, each with its gradient."""
    layers = student.model.layers
    in_layers = {id(p) for p in layers.parameters()}
    root = nbytes(p for p in student.parameters() if id(p) not in in_layers)
    layer = nbytes(layers[0].parameters())
    whole = training_bytes(student, GPU)
    for world in (2, 4):
        got = training_bytes(student, GPU, sharded=True, world=world)
        assert got == -(-whole // world) + 2 * (root + 2 * layer)
    tc = TrainConfig(tokens=10**6, seqlen=64, tokens_per_step="auto")
    free = whole  # does not fit on one device, fits sharded over 4
    fake_free(monkeypatch, free)
    with pytest.raises(CompressError, match="needs"):
        plan_batch(tc, 1, GPU, student)
    assert training_bytes(student, GPU, sharded=True, world=4) < free
    assert plan_batch(tc, 4, GPU, student, sharded=True).batch_size >= 1
