"""bench_decode's context-length axis: system names, cache specs, phases, the table's ratios and
bars (on given figures: nothing is timed here), and the real-text requirement."""

import argparse

import bench_decode as bd
import pytest

from compress.errors import CompressError


def args_for(folders=("default=/m",)):
    return argparse.Namespace(folders=list(folders))


def test_kv_spec_and_check():
    assert bd.kv_spec("fp16") == ("fp16", {})
    assert bd.kv_spec("kivi:bits=4,group=32") == ("kivi", {"bits": 4, "group": 32})
    assert bd.kv_spec("packkv:k_rel=0.05,order=median") == (
        "packkv",
        {"k_rel": 0.05, "order": "median"},
    )
    bd.check_kvs(["fp16", "kivi:bits=4", "packkv:residual=64"])
    with pytest.raises(ValueError, match="unknown cache 'int3'"):
        bd.check_kvs(["int3"])
    with pytest.raises(ValueError, match="no option"):
        bd.check_kvs(["kivi:rel=0.1"])
    with pytest.raises(ValueError, match="KEY=VALUE"):
        bd.kv_spec("kivi:bits")


def test_folder_systems_and_phases():
    args = args_for(["default=/m", "gqa=/g"])
    assert bd.folder_system("default[kivi:bits=4]@2048", args) == ("/m", "kivi:bits=4", 2048)
    assert bd.folder_system("gqa[fp16]", args) == ("/g", "fp16", None)
    assert bd.folder_system("ours-int4+compile", args) is None
    systems = [
        "ours-fp32",
        "ours-fp32+compile",
        "gqa[fp16]@512",
        "gqa[packkv]@512",
        "gqa[fp16]@8000",
    ]
    assert bd.phases(systems, args) == [
        ("decode", ["ours-fp32", "ours-fp32+compile"]),
        ("decode", ["gqa[fp16]@512", "gqa[packkv]@512"]),
        ("decode", ["gqa[fp16]@8000"]),
        ("prefill", ["ours-fp32"]),
    ]


def row(tok_s):
    return {
        "decode_tok_s": tok_s,
        "peak_mem_bytes": 700 * 2**20,
        "kv_bytes": 3 * 2**20,
        "kv_bytes_per_token": 1536.0,
        "prefill_tok_s": 400.0,
    }


def test_context_table_ratios_and_bars():
    results = {
        "default[fp16]@2048": row(20.0),
        "default[packkv]@2048": row(15.0),  # 0.75x: below the 0.8 bar
        "default[kivi:bits=4]@2048": row(19.0),
        "default[fp16]@8000": row(10.0),
        "default[packkv]@8000": row(12.5),  # 1.25x: above the 1.0 bar
        "default[kivi:bits=4]@8000": {"error": "worker exited with status 1", "disk_bytes": 0},
    }
    args = args_for()
    lines = bd.context_table(results, args)
    assert len(lines) == 2 + len(results)
    assert "| 2048 | default | packkv | 15.0 | 0.75x | 700 | 3.0 | 1536 | 400 |" in lines
    assert any("kivi:bits=4 | worker exited" in line for line in lines)
    bars = bd.context_targets(results, args)
    assert "default[packkv]@2048 / fp16 cache decode: 0.75x (bar for packkv >= 0.8): FAIL" in bars
    assert "default[packkv]@8000 / fp16 cache decode: 1.25x (bar for packkv >= 1.0): PASS" in bars
    assert "default[kivi:bits=4]@2048 / fp16 cache decode: 0.95x (bar for packkv >= 0.8)" in bars
    assert len(bars) == 3  # fp16 rows and rows without figures have no ratio


class Words:
    """A tokenizer stand-in: one id per word."""

    def __call__(self, text):
        return argparse.Namespace(input_ids=list(range(len(text.split()))))


def test_long_prompts_need_the_real_text(monkeypatch, tmp_path):
    monkeypatch.delenv("COMPRESS_DATA_DIR", raising=False)
    with pytest.raises(CompressError, match="COMPRESS_DATA_DIR"):
        bd.prompt_ids(Words(), 512, real=True)
    assert len(bd.prompt_ids(Words(), 32)) == 32  # short prompts keep the stand-in sentence
    monkeypatch.setenv("COMPRESS_DATA_DIR", str(tmp_path))
    with pytest.raises(CompressError, match="not found"):
        bd.prompt_ids(Words(), 512, real=True)
    (tmp_path / "wikitext-2").mkdir()
    (tmp_path / "wikitext-2" / "wiki.test.raw").write_text("a b c " * 50)
    with pytest.raises(CompressError, match="150 tokens, not 512"):
        bd.prompt_ids(Words(), 512, real=True)
    assert bd.prompt_ids(Words(), 100, real=True) == list(range(100))
