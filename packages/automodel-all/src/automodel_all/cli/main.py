"""``automodel``: train a model (``automodel train``) or dry-run its layout (``automodel plan``).

Options override the job file; each maps onto one YAML key (``--tp 2`` is ``parallelism: {tp_size:
2}``), and ``--set section.key=value`` reaches any key. docs/cli.md lists them all.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import logging
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import yaml

from automodel_all.cli.yaml_source import ConfigError, RawJob, load_yaml

__all__ = ["build_parser", "job_from_args", "main"]


def _names(text: str) -> list[str]:
    """A comma-separated list: ``jsonl,wandb`` -> ``["jsonl", "wandb"]`` (empty: none)."""
    return [name.strip() for name in text.split(",") if name.strip()]


@dataclass(frozen=True)
class _Option:
    flags: tuple[str, ...]
    section: str
    key: str
    kind: Callable[[str], Any] | None  # None: a switch that sets True
    help: str
    choices: tuple[str, ...] = ()
    """An optional value: the flag alone means the first choice, or it names one of them."""
    implies: tuple[str, ...] = ()
    """Further switches of the option's section it turns on: what it cannot work without."""


_OPTIONS: tuple[_Option, ...] = (
    # model and data
    _Option(
        ("--model",), "model", "name_or_path", str, "HF model folder or cached hub id (default: embedded)"
    ),
    _Option(("--dtype",), "model", "dtype", str, "parameter dtype: float32, bfloat16 or float16"),
    _Option(
        ("--data",),
        "data",
        "path",
        str,
        "data file or folder, save_to_disk folder, builtin:chat or builtin:image_chat",
    ),
    _Option(("--eval-data",), "data", "eval_path", str, "evaluation data (file, folder, builtin:chat)"),
    _Option(("--eval-split",), "data", "eval_split", str, "split to evaluate on, e.g. validation"),
    _Option(("--packing",), "data", "packing", str, "concat, packed or padded (default by format)"),
    _Option(("--tokenizer",), "data", "tokenizer", str, "tokenizer folder or cached hub id"),
    _Option(("--seq-len",), "data", "seq_len", int, "tokens per training row"),
    _Option(("--streaming",), "data", "streaming", None, "stream the training data, packing rows on the fly"),
    # strategy and sizes
    _Option(("--strategy",), "distributed", "strategy", str, "fsdp2 (default), ddp or megatron_fsdp"),
    _Option(("--dp",), "parallelism", "dp_size", int, "data-parallel size (default: inferred)"),
    _Option(("--dp-replicate",), "parallelism", "dp_replicate_size", int, "HSDP replicas (FSDP2)"),
    _Option(("--tp",), "parallelism", "tp_size", int, "tensor-parallel size"),
    _Option(("--pp",), "parallelism", "pp_size", int, "pipeline-parallel size"),
    _Option(("--cp",), "parallelism", "cp_size", int, "context-parallel size"),
    _Option(
        ("--cp-ulysses-degree",),
        "parallelism",
        "cp_ulysses_degree",
        int,
        "cp ranks splitting heads by all-to-all: 1 ring (default), the cp size all-to-all, between: both",
    ),
    _Option(("--ep",), "parallelism", "ep_size", int, "expert-parallel size (MoE models)"),
    _Option(("--sequence-parallel",), "distributed", "sequence_parallel", None, "sequence parallelism (TP)"),
    _Option(("--pp-schedule",), "pipeline", "pp_schedule", str, "gpipe, 1f1b, interleaved_1f1b, ..."),
    _Option(
        ("--activation-checkpointing",),
        "distributed",
        "activation_checkpointing",
        str,
        "recompute whole blocks (full, the default) or keep their matmuls' outputs (selective)",
        choices=("full", "selective"),
    ),
    _Option(
        ("--async-tp",),
        "distributed",
        "enable_async_tensor_parallel",
        None,
        "overlap TP's collectives with the matmuls they feed (implies --sequence-parallel, compiled blocks)",
        implies=("sequence_parallel", "enable_compile"),
    ),
    # adapters and precision
    _Option(
        ("--lora",), "peft", "", None, "LoRA adapters on every linear layer but the head, and on MoE experts"
    ),
    _Option(("--dora",), "peft", "use_dora", None, "DoRA adapters (implies --lora)"),
    _Option(("--lora-rank",), "peft", "dim", int, "LoRA rank (implies --lora)"),
    _Option(("--qat",), "qat", "", None, "quantization-aware training (int8 activations, int4 weights)"),
    _Option(("--fp8",), "fp8", "enabled", None, "float8 training of linear layers (emulated on CPU)"),
    _Option(("--compile",), "compile", "enabled", None, "torch.compile the transformer blocks"),
    # training loop
    _Option(("--steps",), "train", "steps", int, "optimizer steps"),
    _Option(("--global-batch-size",), "train", "global_batch_size", int, "rows per step over all ranks"),
    _Option(
        ("--micro-batch-size",), "train", "micro_batch_size", int, "rows per forward (and PP microbatch)"
    ),
    _Option(("--lr",), "train", "lr", float, "peak learning rate"),
    _Option(("--warmup-steps",), "train", "warmup_steps", int, "linear warm-up steps"),
    _Option(("--seed",), "train", "seed", int, "random seed"),
    _Option(
        ("--checkpoint-every",), "train", "checkpoint_every", int, "steps between distributed checkpoints"
    ),
    _Option(("--output-dir",), "train", "output_dir", str, "where checkpoints and the model go"),
    _Option(("--resume",), "train", "resume", None, "continue from the latest distributed checkpoint"),
    _Option(
        ("--resume-fallback",), "train", "resume_fallback", None, "resume from an older checkpoint if needed"
    ),
    _Option(("--eval-every",), "train", "eval_every", int, "steps between evaluations (0: at the end)"),
    _Option(
        ("--report-to",), "report", "to", _names, "metric sinks: jsonl (default), tensorboard, wandb, mlflow"
    ),
    # launcher (torchrun's flags)
    _Option(("--nproc-per-node",), "launch", "nproc_per_node", int, "workers on this node"),
    _Option(("--nnodes",), "launch", "nnodes", int, "number of nodes"),
    _Option(("--node-rank",), "launch", "node_rank", int, "this node's rank"),
    _Option(("--rdzv-endpoint",), "launch", "rdzv_endpoint", str, "HOST:PORT of the c10d rendezvous"),
    _Option(("--rdzv-backend",), "launch", "rdzv_backend", str, "rendezvous backend (c10d, static)"),
    _Option(("--rdzv-id",), "launch", "rdzv_id", str, "job id shared by the nodes"),
    _Option(("--master-addr",), "launch", "master_addr", str, "node 0's address (static rendezvous)"),
    _Option(("--master-port",), "launch", "master_port", int, "node 0's port (static rendezvous)"),
    _Option(("--max-restarts",), "launch", "max_restarts", int, "worker-group restarts on failure"),
    _Option(
        ("--shutdown-timeout",), "launch", "shutdown_timeout", int, "seconds to checkpoint after SIGTERM"
    ),
    _Option(("--device",), "launch", "device", str, "auto (default), cpu or cuda"),
    _Option(
        ("--host-allocator",),
        "launch",
        "host_allocator",
        str,
        "workers' malloc: auto (default), glibc, mimalloc",
    ),
)


def _dest(option: _Option) -> str:
    return option.flags[0].lstrip("-").replace("-", "_")


def _add_job_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", nargs="?", help="YAML job file (optional; options override it)")
    for option in _OPTIONS:
        if option.kind is None:
            parser.add_argument(
                *option.flags, dest=_dest(option), action="store_true", default=None, help=option.help
            )
        elif option.choices:
            parser.add_argument(
                *option.flags,
                dest=_dest(option),
                nargs="?",
                const=option.choices[0],
                choices=option.choices,
                default=None,
                help=option.help,
            )
        else:
            parser.add_argument(
                *option.flags, dest=_dest(option), default=None, metavar=option.key.upper(), help=option.help
            )
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="set any job key (VALUE is YAML), e.g. --set distributed.reshard_after_forward=false",
    )


def build_parser() -> argparse.ArgumentParser:
    """The ``automodel`` argument parser (subcommands ``train`` and ``plan``)."""
    parser = argparse.ArgumentParser(prog="automodel", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    train = commands.add_parser("train", help="run a training job (no arguments: the embedded default)")
    _add_job_options(train)
    plan = commands.add_parser("plan", help="dry run: mesh layout, steps and memory per rank; no processes")
    _add_job_options(plan)
    plan.add_argument(
        "--world-size", type=_positive_int, default=None, help="ranks to plan for (default: nnodes x nproc)"
    )
    plan.add_argument(
        "--device-memory",
        default=None,
        metavar="SIZE",
        help="memory per device (80GiB, 40GB, or h100, h200, a100-40g, a100-80g, ...): fits or not",
    )
    plan.add_argument(
        "--cluster",
        default=None,
        metavar="NxDEVICE",
        help="the hardware (8xH100, 128xH200, 16xB200, or a YAML file): step time, tokens/s per GPU, MFU",
    )
    plan.add_argument(
        "--calibrate",
        default=None,
        metavar="TRAIN_LOG",
        help="a measured run's train_log.jsonl (same job, same --cluster): fit the fractions of peak to it",
    )
    plan.add_argument("--suggest", action="store_true", help="rank every valid layout of the world size")
    plan.add_argument("--json", dest="as_json", action="store_true", help="print the plan as JSON")
    plan.add_argument(
        "--qlora-bits", type=int, default=None, choices=(4, 8), help="plan a quantized frozen base (QLoRA)"
    )
    return parser


def _convert(option: _Option, text: str) -> Any:
    assert option.kind is not None
    try:
        return option.kind(text)
    except ValueError:
        name = {int: "an integer", float: "a number"}.get(option.kind, "a value")  # type: ignore[call-overload]
        raise ConfigError(f"{option.flags[0]}: expected {name}, got {text!r}") from None


def job_from_args(args: argparse.Namespace) -> RawJob:
    """The job file (if any) with the options applied on top, each recording its option as origin.

    Raises:
        ConfigError: A bad file, or an option value of the wrong type.
    """
    raw = load_yaml(args.config) if args.config else RawJob()
    for option in _OPTIONS:
        value = getattr(args, _dest(option))
        if value is None:
            continue
        flag = option.flags[0]
        if option.section == "peft" or option.section == "qat":
            raw.sections.setdefault(option.section, {})
            raw.origins.setdefault((option.section, None), flag)
            peft = raw.sections.get("peft")
            selectors = ("target_modules", "exclude_modules", "match_all_linear")
            if option.section == "peft" and peft is not None and not any(k in peft for k in selectors):
                raw.set("peft", "match_all_linear", True, flag)
        if option.key:
            raw.set(
                option.section, option.key, True if option.kind is None else _convert(option, value), flag
            )
        for key in option.implies:
            raw.set(option.section, key, True, flag)
        if option.section == "fp8" and "emulate" not in raw.sections["fp8"]:
            import torch

            if not torch.cuda.is_available():
                raw.set("fp8", "emulate", True, flag)  # no float8 matmul kernels on CPU
    for item in args.overrides:
        name, sep, text = item.partition("=")
        section, dot, key = name.partition(".")
        if not sep or not dot or not section or not key:
            raise ConfigError(f"--set {item}: expected SECTION.KEY=VALUE, e.g. --set train.lr=0.001")
        try:
            value = yaml.safe_load(text) if text else None
        except yaml.YAMLError:
            value = text
        raw.set(section, key, value, f"--set {name}")
    return raw


def _positive_int(text: str) -> int:
    """An argparse type: an integer of at least 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected at least 1, got {value}")
    return value


@contextlib.contextmanager
def _cyclic_gc_paused() -> Iterator[None]:
    """Pause Python's cyclic garbage collector for a short command (reference counting still frees).

    ``automodel plan`` imports transformers' modeling code and builds a fake model: millions of new
    objects, over which the collector's generation-2 passes run again and again while nothing they
    create is garbage yet. Pausing it cuts a 405B plan on 1,024 GPUs from 4.6-5.2 to 3.6-4.1 s of wall
    time on a 2-core host (``benchmarks/bench_plan_time.py``); the command ends soon after, so the
    cycles it leaves are freed with the process.
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command; return the exit status (2 for a configuration error)."""
    args = build_parser().parse_args(argv)
    # Models and tokenizers come from folders or the local Hugging Face cache: never wait on the network.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    # torchao registers pytree constants at import with a deprecation warning per process; not ours to fix.
    logging.getLogger("torch.utils._pytree").setLevel(logging.ERROR)
    try:
        raw = job_from_args(args)
        if args.command == "plan":
            from automodel_all.cli.plan import cluster, device_memory, plan

            device = device_memory(args.device_memory) if args.device_memory else None
            hardware = cluster(args.cluster) if args.cluster else None
            with _cyclic_gc_paused():
                report = plan(
                    raw,
                    world_size=args.world_size,
                    device_memory=device,
                    suggest=args.suggest,
                    as_json=args.as_json,
                    base_weight_bits=args.qlora_bits,
                    hardware=hardware,
                    calibrate=args.calibrate,
                )
            print(report)
            return 0
        from automodel_all.cli.launch import launch, prepare_job

        resolved, plain = prepare_job(raw)
    except (ConfigError, FileNotFoundError) as exc:
        print(f"automodel {args.command}: error: {exc}", file=sys.stderr)
        return 2
    job = resolved.job
    print(
        f"automodel train: {resolved.world_size} worker(s) on {job.device_type} "
        f"({'gloo' if job.device_type == 'cpu' else 'nccl'}), {job.strategy}, "
        f"{resolved.layout.describe().splitlines()[1].strip()}; {job.train.steps} steps; "
        f"output {job.train.output_dir}",
        flush=True,
    )
    return launch(resolved, plain)


def entry_point() -> None:
    """Console-script entry point (``automodel``).

    ``automodel plan`` opens no file, process group or device, and writes nothing but its report: once
    that is flushed the process leaves without the interpreter's teardown of torch's and transformers'
    modules (about a second on a 2-core host), which would keep a caller reading its output
    (``automodel plan --json | ...``) waiting for nothing.
    """
    code = main()
    if sys.argv[1:2] == ["plan"]:
        sys.stdout.flush()
        sys.stderr.flush()
        logging.shutdown()
        os._exit(code)
    sys.exit(code)


if __name__ == "__main__":
    entry_point()
