"""eval/bench/bench_scale.py at a tiny shape: the random bf16 folder it writes, and one table row."""

import json

import bench_scale
import pytest
import torch
from safetensors import safe_open


def test_make_model_writes_bf16_folder_of_the_shape(tmp_path):
    folder = bench_scale.make_model(tmp_path / "tiny", "tiny")
    config = json.loads((folder / "config.json").read_text())
    assert config["dtype"] == "bfloat16" and config["num_hidden_layers"] == 2
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
        w = f.get_tensor("model.layers.1.mlp.down_proj.weight")
        norm = f.get_tensor("model.layers.0.input_layernorm.weight")
    assert "lm_head.weight" in names  # the tiny shape is untied
    assert w.dtype == torch.bfloat16 and w.shape == (128, 256)
    assert 0.015 < w.float().std().item() < 0.025 and torch.equal(norm, torch.ones_like(norm))
    assert bench_scale.n_params(bench_scale.hf_config("tiny")) == sum(
        f.numel() for f in _tensors(folder)
    )


def _tensors(folder):
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        return [f.get_tensor(k) for k in f.keys()]


@pytest.mark.slow
def test_quick_table(tmp_path, capsys):
    bench_scale.main(["--quick", "--rows", "rtn:tiny", "--work", str(tmp_path)])
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.startswith("| rtn:tiny"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[-2] == "disk" and float(cells[5]) > 0  # offload, peak RSS GB
