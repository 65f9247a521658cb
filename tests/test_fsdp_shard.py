"""``compress.methods.distill.fsdp.shard`` in this process (gloo, one rank): the student's copy is never
moved to the device whole; each unit reaches ``fully_shard`` still unsharded on the CPU, one
decoder layer at a time, then the root with the rest, and computes what the student computes.
On a GPU, ``fully_shard`` then moves only that unit before keeping its slice (checked by reading
torch's ``_fsdp_init._move_states_to_device``: no GPU in this suite). The two-process runs are
``tests/test_distill_fsdp.py``."""

import pytest
import torch
import torch.distributed as dist
import torch.distributed.fsdp as torch_fsdp
from torch.distributed.tensor import DTensor

from compress.methods.distill import fsdp
from tests.conftest import make_tiny_model

SMALL = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2)


@pytest.fixture
def one_rank(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize("device", ["cpu", "cpu:0"])  # accelerate's name for it: "cpu:0"
def test_shard_moves_one_unit_at_a_time(one_rank, monkeypatch, device):
    model = make_tiny_model(**SMALL)
    units, moved_whole = [], []
    real_shard, real_to = torch_fsdp.fully_shard, torch.nn.Module.to

    def spy_shard(module, **kw):
        params = list(module.parameters())
        units.append(
            (
                module,
                sum(p.numel() for p in params if not isinstance(p, DTensor)),
                all(p.device.type == "cpu" for p in params),
                getattr(kw.get("mesh"), "device_type", None),
            )
        )
        return real_shard(module, **kw)

    def spy_to(module, *a, **k):
        moved_whole.append(type(module).__name__)
        return real_to(module, *a, **k)

    monkeypatch.setattr(torch_fsdp, "fully_shard", spy_shard)
    monkeypatch.setattr(torch.nn.Module, "to", spy_to)
    work = fsdp.shard(model, device)
    monkeypatch.undo()

    assert moved_whole == []  # no .to() of the copy (the old code moved it whole first)
    layer = sum(p.numel() for p in model.model.layers[0].parameters())
    assert [(n, cpu, mesh) for _, n, cpu, mesh in units] == [
        (layer, True, "cpu"),
        (layer, True, "cpu"),
        (model.num_parameters() - 2 * layer, True, "cpu"),  # the root: what the layers left
    ]
    assert units[0][0] is work.model.layers[0] and units[-1][0] is work
    assert all(isinstance(p, DTensor) for p in work.parameters())
    assert not any(isinstance(p, DTensor) for p in model.parameters())  # the caller's, untouched
    ids = torch.randint(0, 49152, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(work(ids).logits, model(ids).logits, rtol=0, atol=1e-6)
