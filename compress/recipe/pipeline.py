"""checkpoint -> stages -> run folder -> eval -> report.

``run(cfg, run_dir)`` loads the source model, applies the recipe's stages in
order (each a function ``(model, ctx) -> model``), writes the checkpoint into a
temporary sibling of ``run_dir``, evaluates *the saved checkpoint* against the
source, writes report and manifest, and only then renames the folder into
place. An interrupted run leaves no run folder that looks complete.

A run claims its folder first (``run_folder.lock_folder``: a second run into the same folder
is refused) and removes the temporary and spill folders that killed runs into it left
(``run_folder.sweep``). A full disk is one paragraph (``run_folder.no_space``).

``COMPRESS_TEST_PAUSE_AT=POINT`` (tests only) stops the run at POINT, one of ``PAUSE_POINTS``:
it prints ``compress: paused at POINT (pid N)`` on stderr and sleeps (up to 5 minutes, then goes
on), for a test to kill it there (``tests/test_robust_run_folder.py``).
"""

import logging
import os
import resource
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from compress.arch.adapters import get_adapter
from compress.decoder.runtime import fast_head, resolve_runtime
from compress.errors import CompressError, as_interrupt
from compress.eval.decode_speed import measure
from compress.eval.kernel_cost import kernel_figures
from compress.eval.perplexity import evaluate
from compress.eval.run_report import write_report
from compress.io.checkpoint import (
    load_run,
    open_lazy,
    save_checkpoint,
    save_entries,
    unquantized_dtype,
)
from compress.io.data import calib_samples, eval_windows, read_text
from compress.io.manifest import verify_folder, write_manifest
from compress.io.offload import is_lazy, resident_to, share_unchanged
from compress.io.run_folder import (
    atomic_dir,
    check_writable,
    commit_dir,
    lock_folder,
    no_space,
    spill_dir,
    sweep,
)
from compress.io.source import cache_dir, load_lazy, load_model, resolve_path
from compress.layers.head import quantize_head
from compress.recipe.config import (
    check_distributed,
    check_experts,
    check_offload,
    layerwise,
    recipe_device,
    run_eval_device,
    validate,
)
from compress.recipe.hub import push_after_run
from compress.recipe.inputs import check_inputs
from compress.recipe.model_card import write_model_card
from compress.recipe.stages import get_stage

log = logging.getLogger(__name__)

RUN_DIR = "run folder (hydra.run.dir)"
PAUSE_ENV = "COMPRESS_TEST_PAUSE_AT"
# the spill holds the stages' layers; the temporary folder exists; it holds the checkpoint;
# it holds the manifest (the rename into place is next)
PAUSE_POINTS = ("spill_made", "temp_made", "weights_written", "manifest_written")


def pause_point(point: str) -> None:
    """Stop here when ``COMPRESS_TEST_PAUSE_AT`` names ``point`` (tests kill the run there)."""
    if os.environ.get(PAUSE_ENV) != point:
        return
    print(f"compress: paused at {point} (pid {os.getpid()})", file=sys.stderr, flush=True)
    time.sleep(300)


@dataclass
class Context:
    """What a stage may read (cfg, tokenizer) and write (quantization_config, record)."""

    cfg: DictConfig
    tokenizer: object
    quantization_config: dict | None = None
    record: dict = field(default_factory=dict)  # extra report fields: bits, per-layer stats, ...
    run_dir: Path | None = (
        None  # the final run folder (resumable stages keep checkpoints beside it)
    )
    files: dict = field(
        default_factory=dict
    )  # extra files for the run folder: {relative name: path to copy}
    calib_tokens: torch.Tensor | None = None  # given tokens instead of cfg.data.calib.source
    # how the saved folder is run for the report, when a stage changes that (IAM: with a small
    # model alongside): folder -> (model, tokenizer) for eval, (folder, dtype) -> decoder model
    eval_loader: object = None
    decode_loader: object = None
    device: torch.device = torch.device(
        "cpu"
    )  # where calibration runs (``device``), a layer at a time

    def calibration(self) -> torch.Tensor:
        """``[samples, seqlen]`` calibration tokens (``cfg.calib``)."""
        if self.calib_tokens is not None:
            return self.calib_tokens
        c = self.cfg.calib
        text = read_text(self.cfg.data.calib.source, role="calib")
        return calib_samples(self.tokenizer, text, c.samples, c.seqlen, seed=self.cfg.seed)


def _weight_bytes(model, dtype=None, qcfg=None) -> tuple[int, int]:
    """Bytes of every saved tensor (as ``save_checkpoint(..., qcfg, dtype)`` writes them), and of
    the decoder linears alone."""

    entries = save_entries(model, dtype, qcfg)
    prefixes = tuple(f"{name}." for name in get_adapter(model.config).all_linears(model))
    total = sum(e.nbytes for e in entries)
    linear = sum(e.nbytes for e in entries if e.name.startswith(prefixes))
    return total, linear


def save_dtype(model, source, trust_remote_code: bool):
    """Dtype of a quantized run's unquantized tensors (``checkpoint.unquantized_dtype``)."""
    from transformers import AutoConfig

    stored = AutoConfig.from_pretrained(source.path, trust_remote_code=trust_remote_code).dtype
    return unquantized_dtype(model, stored)


def _check_run_dir(run_dir: Path) -> None:
    if run_dir.exists() and any(run_dir.iterdir()):
        raise CompressError(
            f"run folder '{run_dir}' already exists and is not empty; pick another "
            f"hydra.run.dir, or remove that folder."
        )


def check_run(cfg: DictConfig, run_dir: Path) -> None:
    """What a run checks before the model loads: the config (``config.validate``), the run
    folder, every text it reads (``inputs.check_inputs``), and a source run folder against its
    manifest (``manifest.verify_folder``; ``model.verify=false`` skips that)."""
    validate(cfg)
    check_writable(run_dir, "run folder (hydra.run.dir)")
    _check_run_dir(run_dir)
    if cfg.model.get("verify", True):
        where, _ = resolve_path(str(cfg.model.path))
        if isinstance(where, Path):
            verify_folder(where, skip="model.verify=false")
    check_inputs(cfg)


def _leader() -> bool:
    """Whether this process writes the run folder (process 0 of ``accelerate launch``)."""
    world = int(os.environ.get("WORLD_SIZE", "1") or 1)
    return world <= 1 or int(os.environ.get("RANK", "0") or 0) == 0


def hydra_files(run_dir: Path) -> list[Path]:
    """What Hydra wrote into ``run_dir`` before the run: ``hydra.output_subdir`` (the recipes
    set null) and the files of ``hydra/job_logging``'s file handlers (the recipes log to
    stdout)."""
    found = []
    try:
        from hydra.core.hydra_config import HydraConfig

        if HydraConfig.initialized():
            hc = HydraConfig.get()
            if hc.output_subdir and Path(hc.runtime.output_dir).resolve() == run_dir.resolve():
                found.append(run_dir / hc.output_subdir)
    except ImportError:
        pass
    for h in _file_handlers(run_dir):
        found.append(Path(h.baseFilename))
    return [p for p in dict.fromkeys(found) if p.exists()]


def _loggers() -> list[logging.Logger]:
    named = logging.Logger.manager.loggerDict.values()
    return [logging.getLogger()] + [x for x in named if isinstance(x, logging.Logger)]


def _file_handlers(run_dir: Path) -> list[logging.FileHandler]:
    inside = run_dir.resolve()
    return [
        h
        for lg in _loggers()
        for h in lg.handlers
        if isinstance(h, logging.FileHandler) and inside in Path(h.baseFilename).resolve().parents
    ]


def refuse_hydra_files(run_dir: Path, remove: bool) -> None:
    """Refuse ``hydra.output_subdir`` and a ``hydra/job_logging`` that writes a file into the
    run folder: the folder holds only what the run writes (every file is listed in the manifest
    and checked on load). ``remove``: delete what Hydra wrote there (the writer of the folder)."""
    found = hydra_files(run_dir)
    if not found:
        return
    handlers = _file_handlers(run_dir)
    for lg in _loggers():
        for h in [h for h in lg.handlers if h in handlers]:
            lg.removeHandler(h)
            h.close()
    for p in found if remove else ():
        if p.is_dir():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)
    names = ", ".join(f"'{p.relative_to(run_dir)}'" for p in found)
    raise CompressError(
        f"Hydra wrote {names} into the run folder '{run_dir}' (hydra.output_subdir or a "
        f"hydra/job_logging with a log file), but a run folder holds only what the run writes: "
        f"every file is listed in manifest.json and checked on load. Leave both at the recipes' "
        f"defaults (hydra.output_subdir=null, hydra/job_logging=stdout): manifest.json records "
        f"the resolved recipe, and the log goes to stdout (`... 2>&1 | tee run.log` keeps it)."
    )


def run(cfg: DictConfig, run_dir: Path) -> dict:
    """Run a recipe into ``run_dir``; returns the report.

    The folder is claimed first (``lock_folder``: another run into it is refused) and what
    killed runs into it left is removed (``sweep``). Ctrl-C raises ``Interrupted`` (a
    KeyboardInterrupt) naming the temporary folder it removed.
    """
    run_dir = Path(run_dir)
    lock = None
    try:
        with no_space(run_dir, "run folder"):
            check_writable(run_dir, RUN_DIR)
            if _leader():
                lock = lock_folder(run_dir, RUN_DIR)
            refuse_hydra_files(run_dir, remove=lock is not None)
            if lock is not None:
                sweep(run_dir, lock)
            check_run(cfg, run_dir)
            return _run(cfg, run_dir)
    except BaseException as e:
        placeholder = lock is not None or not _leader()  # never another run's folder
        if placeholder and run_dir.is_dir() and not run_dir.is_symlink():
            if not any(run_dir.iterdir()):
                run_dir.rmdir()  # Hydra's empty placeholder: no folder rather than an empty one
        out = as_interrupt(e)  # before the temporary folder existed
        if out is not e:
            raise out from None
        raise
    finally:
        if lock is not None:
            lock.release()


def decoder_default(folder: Path, head: str) -> dict:
    """``decoder_default``: the runtime ``python -m compress.decoder RUN`` resolves on the CPU
    (``compress.decoder.runtime.resolve_runtime``) for a group-quantized folder; nothing for
    other folders."""
    conf = resolve_runtime(folder, "cpu", {"head": head} if head != "none" else None)
    return {"decoder_default": conf.as_dict()} if conf.fast else {}


def decode_figures(folder: Path, ids: list[int], dcfg, loader=None, head: str = "none") -> dict:
    """``compress.eval.decode_speed.measure``; a folder the decoder cannot run gets ``decode_error``."""

    log.info(
        "decoder: %d tokens after a %d-token prompt (%s, kv %s, head %s%s)",
        dcfg.new_tokens,
        dcfg.prompt_tokens,
        dcfg.dtype,
        dcfg.kv,
        head,
        ", compiled" if dcfg.compile else "",
    )
    try:
        return measure(folder, ids, dcfg, loader, head)
    except CompressError as e:
        log.warning("the built-in decoder could not run this folder: %s", e)
        return {"decode_error": str(e)}


def load_source(cfg: DictConfig, run_dir: Path):
    """``(model, tokenizer, Source, spill folder or None)``: disk-backed (``compress.io.offload``)
    when ``offload`` allows it and every stage works layer by layer, else the whole model."""
    m = cfg.model
    offload = check_offload(cfg)
    if offload != "host" and layerwise(cfg) and m.dtype in ("auto", "float32"):
        spill = spill_dir(run_dir)
        try:
            got = load_lazy(m.path, m.trust_remote_code, spill)
        except BaseException:
            shutil.rmtree(spill, ignore_errors=True)
            raise
        if got is not None:
            log.info("source layers stay on disk, read one at a time (offload=%s)", offload)
            return (*got, spill)
        spill.rmdir()
    if offload == "disk":
        raise CompressError(
            f"offload=disk: the source '{m.path}' cannot be read one layer at a time (it is a "
            f"hub id, needs remote code, has no safetensors, model.dtype={m.dtype} is not "
            f"auto or float32, or its layers keep state outside their weights). Download it to "
            f"a folder first, or use offload=auto."
        )
    return (*load_model(m.path, m.dtype, m.trust_remote_code), None)


def _run(cfg: DictConfig, run_dir: Path) -> dict:
    start = time.time()
    torch.manual_seed(cfg.seed)
    stage_fns = [(name, get_stage(name).run) for name in cfg.stages]
    model, tok, source, spill = load_source(cfg, run_dir)
    check_experts(cfg, model.config)  # a hub id's config is known only now
    held = {"model": model}  # the stages' model is dropped once saved (before the evaluation)
    del model
    try:
        return _stages_and_export(cfg, run_dir, stage_fns, held, tok, source, spill, start)
    finally:
        if spill is not None:
            shutil.rmtree(spill, ignore_errors=True)


def _stages_and_export(cfg, run_dir, stage_fns, held, tok, source, spill, start) -> dict:
    m = cfg.model
    model = held.pop("model")
    lazy = is_lazy(model)
    ctx = Context(cfg=cfg, tokenizer=tok, run_dir=run_dir, device=recipe_device(cfg))
    if ctx.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    timings = {}
    for name, fn in stage_fns:
        t = time.time()
        log.info("stage %s", name)
        model = fn(model, ctx)
        timings[name] = round(time.time() - t, 2)
    if spill is not None:
        pause_point("spill_made")
    rank = int(os.environ.get("RANK", "0") or 0)
    if check_distributed(cfg) > 1 and rank != 0:  # process 0 exports and evaluates
        log.info("process %d: stages done; process 0 writes the run folder", rank)
        return {"recipe": cfg.name, "rank": rank, "stages": timings}

    head = (cfg.get("quant") or {}).get("lm_head", "none")
    tmp = None
    try:
        tmp = atomic_dir(run_dir)  # inside the try: a Ctrl-C right after it still removes it
        pause_point("temp_made")
        t = time.time()
        dtype = save_dtype(model, source, m.trust_remote_code) if ctx.quantization_config else None
        weight_bytes, linear_bytes = _weight_bytes(model, dtype, ctx.quantization_config)
        save_checkpoint(model, tok, tmp, ctx.quantization_config, dtype)
        if spill is not None:
            shutil.rmtree(spill, ignore_errors=True)
        for name, src in ctx.files.items():  # e.g. importance/scores.safetensors
            (tmp / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(src, tmp / name)
        del model
        pause_point("weights_written")
        timings["export"] = round(time.time() - t, 2)

        t = time.time()
        windows = eval_windows(
            tok, read_text(cfg.data.eval.source, role="eval"), cfg.eval.seqlen, cfg.eval.windows
        )
        device = run_eval_device(cfg)
        # evaluate what was saved, not the in-memory model; the head as the decoder loads it;
        # a disk-backed run reads both models' layers one at a time (compress.io.offload)
        if lazy and ctx.eval_loader is None:
            compressed = open_lazy(tmp)
            reference = (
                load_lazy(m.path, m.trust_remote_code)[0] if cfg.eval.compare_source else None
            )
            if reference is not None:  # the tensors the recipe kept as stored, mapped once
                share_unchanged(compressed, reference)
        else:
            compressed = (ctx.eval_loader or load_run)(tmp)[0]
            reference = None
            if cfg.eval.compare_source:
                reference = load_model(m.path, m.dtype, m.trust_remote_code)[0].to(device)
        quantize_head(compressed, head, ctx.quantization_config)
        compressed = resident_to(compressed, device)
        if is_lazy(reference):
            reference = resident_to(reference, device)
        cache = (
            cache_dir() / "logprobs" if cfg.eval.get("cache_logprobs") and source.sha256 else None
        )
        figures = evaluate(
            compressed, windows, reference, cache=cache, source_sha=source.sha256, device=device
        )
        kernel = cfg.decode.get("kernel", "exact")  # a kernel that is not bit-faithful: its cost
        if kernel != "exact":
            eval_kw = dict(cache=cache, source_sha=source.sha256)
            exact = dict(figures)
            figures.update(kernel_figures(compressed, windows, reference, kernel, exact, **eval_kw))
            if (
                head == "none" and (default_head := fast_head(tmp)) != "none"
            ):  # and the default head
                quantize_head(compressed, default_head, ctx.quantization_config)
                figures.update(
                    kernel_figures(
                        compressed, windows, reference, kernel, exact, "default", **eval_kw
                    ),
                    default_head=default_head,
                )
        del compressed, reference
        timings["eval"] = round(time.time() - t, 2)

        if cfg.decode.enabled:  # the built-in decoder loads and runs what was saved
            t = time.time()
            figures.update(
                decode_figures(tmp, windows[0].tolist(), cfg.decode, ctx.decode_loader, head)
            )
            timings["decode"] = round(time.time() - t, 2)

        report = {
            "recipe": cfg.name,
            "model": source.name,
            **figures,
            "weight_bytes": weight_bytes,
            "linear_weight_bytes": linear_bytes,
            "lm_head": head,
            **decoder_default(tmp, head),
            **ctx.record,
            "stages": timings,
            "elapsed_s": round(time.time() - start, 2),
            "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            **(
                {"peak_device_bytes": torch.cuda.max_memory_allocated()}
                if torch.cuda.is_available() and torch.cuda.is_initialized()
                else {}
            ),
            "device": str(ctx.device),
            "offload": "disk" if lazy else "host",
            "trust_remote_code": bool(m.trust_remote_code),
        }
        recipe = OmegaConf.to_container(cfg, resolve=True)
        write_report(tmp, report)
        write_model_card(tmp, report, recipe, {"name": source.name, "path": source.path})
        write_manifest(tmp, recipe, source, timings, bool(m.trust_remote_code))
        pause_point("manifest_written")
        commit_dir(tmp, run_dir)
    except BaseException as e:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        out = as_interrupt(e, tmp)
        if out is not e:
            raise out from None
        raise
    log.info("run folder: %s", run_dir)
    push_after_run(run_dir, cfg.get("hub"))
    return report
