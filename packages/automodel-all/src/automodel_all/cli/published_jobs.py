"""Published runs (`automodel_planner.published_runs`) as the ``automodel plan`` jobs a user would write.

`published_job` turns a row into a job (its model's config saved in a folder, its layout, batch,
checkpointing, compile, float8, async TP, pipeline schedule and adapters as job settings), so that
``automodel plan --cluster ... --suggest`` can be asked what it would pick for the cluster of a published
run: the generated docs tabulate that against the published layout (``tools/throughput_doc.py``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from automodel_all.cli.yaml_source import RawJob

__all__ = ["published_job"]

_ORIGIN = "published run"


def published_job(run: Any, folder: str | Path) -> RawJob:
    """The job of ``run`` (an `automodel_planner.PublishedRun`); its model's config is saved in ``folder``.

    The global batch is the row's: its local batch times its data-parallel size, so that every layout
    ``--suggest`` tries trains the same rows per step.

    Args:
        run: The published row.
        folder: An empty or missing folder for the model's ``config.json``.
    """
    from automodel_planner.published import shape_config

    shape_config(run.shape, **run.config).save_pretrained(folder)
    sizes = dict(run.sizes)
    world = run.hardware().count
    model_parallel = sizes.get("tp", 1) * sizes.get("pp", 1) * sizes.get("cp", 1)
    dp = world // model_parallel
    raw = RawJob()
    settings: list[tuple[str, str, Any]] = [
        ("model", "name_or_path", str(folder)),
        ("model", "dtype", run.dtype),
        ("model", "attn_implementation", run.attn_implementation),
        ("data", "seq_len", run.seq_len),
        ("train", "global_batch_size", run.local_batch * dp),
        ("train", "micro_batch_size", run.micro_batch),
        ("distributed", "activation_checkpointing", run.checkpointing),
        ("distributed", "sequence_parallel", run.sequence_parallel),
        ("distributed", "enable_async_tensor_parallel", run.async_tp),
        ("distributed", "enable_compile", run.compile),  # FSDP2's compile, which async TP needs
        *(("distributed", key, value) for key, value in run.strategy.items()),
    ]
    settings += [("parallelism", f"{axis}_size", size) for axis, size in sizes.items() if axis != "dp_shard"]
    settings += [("moe", key, value) for key, value in run.moe.items()]
    if run.compile_loss:  # the compile section compiles the loss too (compile_loss is on by default)
        settings.append(("compile", "enabled", True))
    if run.fp8:
        settings.append(("fp8", "enabled", True))
        settings += [("fp8", key, value) for key, value in run.fp8_config.items()]
    if run.lora_dim is not None:
        settings += [
            ("peft", "target_modules", ["*_proj"]),
            ("peft", "dim", run.lora_dim),
            ("peft", "alpha", 2 * run.lora_dim),
        ]
    if run.pp_schedule is not None:
        settings.append(("pipeline", "pp_schedule", run.pp_schedule))
        if run.layers_per_stage is not None:
            settings.append(("pipeline", "layers_per_stage", run.layers_per_stage))
    for section, key, value in settings:
        raw.set(section, key, value, _ORIGIN)
    return raw
