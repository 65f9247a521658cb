"""The model card: ``README.md`` of a run folder, the page the Hub shows.

YAML front matter: base_model, base_model_relation (quantized runs), library_name,
license (carried over from the source where known), pipeline_tag, tags (compress,
the stages that ran, the bit width). Body: what was done, where the source came from
(the default model is dequantized from a GGUF), the eval table with its protocol, how to
load the model (with transformers or vLLM where the format allows it: AutoAWQ INT4,
bitsandbytes int8, plain checkpoints; always with ``compress.decoder``) and the resolved
recipe without local paths. The pipeline writes it before the manifest, so it is hashed;
a card written without a repo id holds ``ORG/NAME``, which the push fills in.
"""

import json
import re
from pathlib import Path

import yaml

from compress.eval.run_report import bit_width, metrics_table, protocol
from compress.layers import GROUP_QUANTIZED, group_params

PLACEHOLDER_REPO = "ORG/NAME"
PLACEHOLDER_NOTE = f"Replace `{PLACEHOLDER_REPO}` below with this repository's id."


def source_info(source: dict) -> dict:
    """``base_model`` and ``license`` of the source model where they can be known, and for a
    converted GGUF its ``gguf`` file name, ``sha256`` and ``package``."""
    folder, name = Path(source.get("path") or ""), source.get("name") or ""
    if (folder / "source.json").is_file():  # the default model's cache folder
        meta = json.loads((folder / "source.json").read_text())
    elif (folder / "README.md").is_file():  # a downloaded or saved HF folder with its card
        from huggingface_hub.repocard import metadata_load

        meta = {"license": (metadata_load(folder / "README.md") or {}).get("license")}
    else:
        meta = {}
    hub_id = re.search(r"models--([^/]+)--([^/]+)/snapshots/", str(folder))  # the HF cache layout
    if not meta.get("base_model"):
        if hub_id:
            meta["base_model"] = f"{hub_id.group(1)}/{hub_id.group(2)}"
        elif not folder.exists() and re.fullmatch(r"[\w.-]+/[\w.-]+", name):  # loaded by hub id
            meta["base_model"] = name
    keys = ("base_model", "license", "gguf", "sha256", "package")
    return {k: meta[k] for k in keys if meta.get(k)}


def provenance(info: dict) -> str | None:
    """One sentence on a source converted from a GGUF file (the default model's source.json)."""
    if not info.get("gguf"):
        return None
    kind = re.search(r"\.((?:I?Q\d\w*)|F16|BF16|F32)\.gguf$", info["gguf"], re.IGNORECASE)
    where = f" shipped in the `{info['package']}` package" if info.get("package") else ""
    base = info.get("base_model", "the base model")
    return (
        f"The source is `{base}` dequantized to float32 from the "
        f"{kind.group(1) + ' ' if kind else ''}GGUF file `{info['gguf']}`{where}"
        + (f" (sha256 `{info['sha256']}`)" if info.get("sha256") else "")
        + ", not the original checkpoint: its figures are those of that GGUF's weights."
    )


def public_recipe(recipe: dict) -> dict:
    """The resolved recipe without local paths: no ``hydra`` group, and every string that is a
    local path (absolute, ``~``, ``./``, ``../``, or a relative path that exists here) replaced by
    ``<local>/`` and its file name."""

    def local(v: str) -> bool:
        return v.startswith(("/", "~", "./", "../")) or ("/" in v and Path(v).exists())

    def clean(v):
        if isinstance(v, dict):
            return {k: clean(x) for k, x in v.items() if k != "hydra"}
        if isinstance(v, list):
            return [clean(x) for x in v]
        if isinstance(v, str) and local(v):
            return f"<local>/{Path(v).name}"
        return v

    return clean(recipe)


def loaders(config: dict, stages: list) -> list[str]:
    """Which libraries besides compress.decoder can load this checkpoint."""
    qcfg = config.get("quantization_config") or {}
    method = qcfg.get("quant_method")
    if method == "awq":
        return ["transformers", "vllm"]
    if method == "compressed-tensors":  # vLLM's integer kernels take 4 and 8 bits
        return ["transformers", "vllm"] if group_params(qcfg)[0] in (4, 8) else ["transformers"]
    if method == "bitsandbytes":
        return ["transformers"]
    if config.get(
        "auto_map"
    ):  # converted attention (cla, mla): the folder carries its modeling file
        return ["transformers"]
    if method is None and set(stages) <= {
        "gqa",
        "fit",
        "distill",
    }:  # unmodified, or GQA: a plain checkpoint
        return ["transformers", "vllm"]
    return []  # our own formats (quant_method compress, MLA/CLA configs)


def metadata(report: dict, config: dict, recipe: dict, source: dict) -> dict:
    qcfg = config.get("quantization_config") or {}
    bits = bit_width(report, config, recipe)
    # the methods that ran, not the format: an RTN run in AWQ's format is no AWQ run
    tags = ["compress", *recipe.get("stages", []), f"{bits}-bit" if bits else None]
    meta = {k: v for k, v in source_info(source).items() if k in ("base_model", "license")}
    if qcfg and "base_model" in meta:
        meta["base_model_relation"] = "quantized"
    meta["library_name"] = (
        "transformers" if loaders(config, recipe.get("stages", [])) else "compress"
    )
    meta["pipeline_tag"] = "text-generation"
    meta["tags"] = list(dict.fromkeys(t for t in tags if t))
    return meta


def _how_to_load(
    repo_id: str, libs: list[str], method: str | None, remote: bool = False
) -> list[str]:
    lines = ["## How to load", ""]
    if "transformers" in libs:
        needs = {
            "awq": "`pip install gptqmodel`: transformers 5 loads AWQ checkpoints through it",
            "compressed-tensors": "`pip install compressed-tensors`",
            "bitsandbytes": "`pip install bitsandbytes`",
        }.get(method)
        if remote:
            needs = "`trust_remote_code=True`: the attention is this repository's modeling file"
        lines += [
            "With transformers" + (f" (needs {needs}):" if needs else ":"),
            "",
            "```python",
            "from transformers import AutoModelForCausalLM, AutoTokenizer",
            "",
            f'tok = AutoTokenizer.from_pretrained("{repo_id}")',
            f'model = AutoModelForCausalLM.from_pretrained("{repo_id}", device_map="auto"'
            + (", trust_remote_code=True)" if remote else ")"),
            "```",
            "",
        ]
    if "vllm" in libs:
        lines += [
            "With vLLM:",
            "",
            "```bash",
            f"vllm serve {repo_id}" + (" --quantization awq" if method == "awq" else ""),
            "```",
            "",
        ]
    folder = repo_id.split("/")[-1]
    lines += [
        "With compress's own decoder (every format compress writes):",
        "",
        "```bash",
        f"hf download {repo_id} --local-dir {folder}",
        f'python -m compress.decoder {folder} --prompt "The capital of France is"',
        "```",
    ]
    return lines


def default_decoding(report: dict) -> str:
    """What ``python -m compress.decoder FOLDER`` (and the server) does by default on the CPU,
    with the measured cost of its kernel when the run reported one (``decode.kernel``)."""

    conf = report.get("decoder_default") or {}
    kernel, head = conf.get("kernel", "exact"), conf.get("head", "none")
    text = (
        f"Default decoding: on the CPU, `python -m compress.decoder` runs this folder in "
        f"{conf.get('dtype', 'bfloat16')} with the `{kernel}` kernel"
        + (" (activations rounded to int8 per token and 32 channels, integer dot products)"
           if kernel == "w4a8" else "")
        + (f" and the output head quantized to {head}" if head != "none" else "")
        + "; `--dtype float32` runs the bit-faithful path the evaluation below measures. "
        "`python -m compress.serve` serves it the same way, batch-invariant (the kernel at "
        "every batch size, attention in a fixed order): a request's output does not depend on "
        "what else is served."
    )  # fmt: skip
    if "kernel_ppl_cost" in report:
        text += (
            f" Through the `{report['kernel']}` kernel the evaluation's perplexity is "
            f"{report['kernel_ppl']:.4g} ({100 * report['kernel_ppl_cost']:+.2f}% against the "
            f"exact path)"
            + (f", KL vs source {report['kernel_kl_vs_source']:.4g}" if "kernel_kl_vs_source" in report else "")
            + "."
        )  # fmt: skip
    return text


def render(
    report: dict, config: dict, recipe: dict, source: dict, repo_id: str | None = None
) -> str:
    """The model card's text."""
    repo_id = repo_id or PLACEHOLDER_REPO
    meta = metadata(report, config, recipe, source)
    qcfg = config.get("quantization_config") or {}
    stages = recipe.get("stages") or []
    base = meta.get("base_model") or Path(report["model"]).name  # not a local path
    done = (
        f"`{base}` compressed by compress with the recipe `{report['recipe']}` "
        f"(stages: {', '.join(stages) or 'none, the uncompressed baseline'})."
    )
    lines = [
        "---",
        yaml.safe_dump(meta, sort_keys=False).rstrip(),
        "---",
        "",
        f"# {report['recipe']}: {base}",
        "",
        done,
        "",
    ]
    if origin := provenance(source_info(source)):
        lines += [origin, ""]
    if qcfg:
        lines += [f"On-disk format: `quantization_config` = `{json.dumps(qcfg)}`.", ""]
    if report.get("lm_head", "none") != "none":
        lines += [
            f"Output head: the figures below quantize it group-wise to {report['lm_head']} when "
            f"the folder is loaded (`quant.lm_head={report['lm_head']}`, recorded in "
            f"`manifest.json`); the head is stored unquantized, so other loaders run it as "
            f"stored. compress's decoder quantizes it as the evaluation did.",
            "",
        ]
    if qcfg.get("quant_method") in GROUP_QUANTIZED:
        lines += [default_decoding(report), ""]
    if repo_id == PLACEHOLDER_REPO:
        lines += [PLACEHOLDER_NOTE, ""]
    lines += [
        "## Evaluation",
        "",
        protocol(report) + " Perplexity is exp(mean token NLL); KL is "
        "KL(source ‖ this model) in nats per token.",
        "",
        *metrics_table(report),
        "",
        "Every figure is in `report.json`; `manifest.json` lists the size and sha256 of every file, "
        "the source model's sha256 and the compress version.",
        "",
        *_how_to_load(
            repo_id, loaders(config, stages), qcfg.get("quant_method"), bool(config.get("auto_map"))
        ),
        "",
        "## Resolved recipe",
        "",
        "```yaml",
        yaml.safe_dump(public_recipe(recipe), sort_keys=False).rstrip(),
        "```",
    ]
    return "\n".join(lines) + "\n"


def write_model_card(folder: Path, report: dict, recipe: dict, source: dict) -> Path:
    """Write ``folder/README.md`` from the run's report, its config.json and the resolved recipe."""
    folder = Path(folder)
    config = (
        json.loads((folder / "config.json").read_text())
        if (folder / "config.json").exists()
        else {}
    )
    repo_id = (recipe.get("hub") or {}).get("repo_id")
    path = folder / "README.md"
    path.write_text(render(report, config, recipe, source, repo_id))
    return path
