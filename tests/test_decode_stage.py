"""The pipeline's decode stage: torch threads set for the measurement and restored, a log line per
phase, and a bad ``decode.threads`` refused before any work."""

import logging

import pytest
import torch
from omegaconf import OmegaConf

from compress.errors import CompressError
from compress.eval import decode_speed
from tests.conftest import TINY_OVERRIDES, compose


@pytest.fixture
def threads():
    """torch's thread count as the test found it, put back afterwards."""
    before = torch.get_num_threads()
    yield before
    torch.set_num_threads(before)


def test_measure_runs_with_decode_threads_and_restores(tiny_dir, monkeypatch, caplog, threads):
    seen, real = [], decode_speed.generate

    def spy(*args, **kwargs):
        seen.append(torch.get_num_threads())
        return real(*args, **kwargs)

    monkeypatch.setattr(decode_speed, "generate", spy)
    torch.set_num_threads(2)
    cfg = OmegaConf.create(
        {
            "prompt_tokens": 8,
            "new_tokens": 4,
            "prefill_tokens": 16,
            "kv": "fp16",
            "dtype": "float32",
            "compile": False,
            "threads": 1,
        }
    )
    caplog.set_level(logging.INFO, logger=decode_speed.__name__)
    figures = decode_speed.measure(tiny_dir, list(range(100, 140)), cfg)
    assert seen == [1, 1, 1]  # warm-up, decode, prefill: all with one thread
    assert torch.get_num_threads() == 2  # restored
    assert figures["decode_threads"] == 1 and figures["decode_tok_s"] > 0
    phases = [
        r.getMessage().split(": ", 1)[1] for r in caplog.records if r.name == decode_speed.__name__
    ]
    assert [p.split(" ")[0] for p in phases] == [
        "loading",
        "warm-up,",
        "decoding",
        "prefill",
        "done:",
    ]
    assert "decoding 4 tokens after a 8-token prompt" in phases[2]


@pytest.mark.parametrize("bad", ["0", "abc", "1.5", "true"])
def test_bad_threads_refused_before_work(tiny_dir, tmp_path, bad):
    from compress.recipe.pipeline import run

    cfg = compose("rtn_int4", [f"model.path={tiny_dir}", *TINY_OVERRIDES, f"decode.threads={bad}"])
    with pytest.raises(CompressError, match="decode.threads"):
        run(cfg, tmp_path / "run")
    assert not (tmp_path / "run").exists()
