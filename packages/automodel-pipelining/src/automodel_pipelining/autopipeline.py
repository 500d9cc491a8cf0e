"""`AutoPipeline`: split a Hugging Face decoder into pipeline stages and run them with a torch schedule.

Lifecycle: construct it with the meshes and the `PipelineConfig` fields (everything is validated, no
collective runs), call `AutoPipeline.build` once with the model, the loss function and an optional
``parallelize_fn`` (applied to every stage: FSDP2/TP on the non-pipeline mesh axes), then call
`AutoPipeline.step` once per batch on every rank of the pipeline.

``torch.distributed.pipelining`` is imported by `build`, not at import time.
"""

from __future__ import annotations

import json
import logging
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any, Literal

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from automodel_mesh import MeshContext
from automodel_pipelining.config import PipelineConfig
from automodel_pipelining.costs import read_stage_costs
from automodel_pipelining.debug import count_params, pretty_print_stages
from automodel_pipelining.layout import DecoderLayout, resolve_decoder_layout
from automodel_pipelining.schedules import (
    CsvSchedule,
    ScheduleSpec,
    check_microbatches,
    read_csv_schedule,
    resolve_schedule,
    stage_ids_this_rank,
)
from automodel_pipelining.split import calculate_virtual_stages, check_stage_fqns, generate_stage_fqns
from automodel_pipelining.stage_module import build_stage_module, share_sequence_shards
from automodel_pipelining.validate import validate_hf_model_for_pipeline_support

if TYPE_CHECKING:
    from automodel_pipelining._runtime import AutoPipelineStage

__all__ = ["AutoPipeline", "ParallelizeFn", "PipelineInfo"]

logger = logging.getLogger(__name__)

ParallelizeFn = Callable[..., nn.Module | None]
"""``parallelize_fn(stage_module, *, world_mesh, moe_mesh, pp_axis_name, dp_axis_names, cp_axis_name,
tp_axis_name, ep_axis_name, ep_shard_axis_names) -> module or None`` (``None``: changed in place)."""


@dataclass
class PipelineInfo:
    """What this rank holds of the pipeline.

    As in the reference system, before `AutoPipeline.build` ``enabled`` is False and ``schedule``,
    ``model_parts`` and ``stages`` are ``None``.
    """

    enabled: bool
    """Whether the pipeline is built."""
    schedule: Any
    """The torch schedule object (``None`` before `AutoPipeline.build`)."""
    has_first_stage: bool
    has_last_stage: bool
    model_parts: list[nn.Module] | None = None
    """This rank's stage modules, in increasing stage order (``None`` before `AutoPipeline.build`)."""
    stages: list[Any] | None = None
    """This rank's torch ``PipelineStage`` objects, in the same order (``None`` before build)."""


class AutoPipeline:
    """Pipeline parallelism for transformers decoder models on ``torch.distributed.pipelining``.

    Every `PipelineConfig` field and axis name given to the constructor reads as an attribute, as in the
    reference system (``pipe.pp_schedule``, ``pipe.pp_batch_size``, ``pipe.dp_axis_names``); they are
    read-only views of ``pipe.config`` and ``pipe.axis_kwargs``.

    Splits the model by module FQNs (embeddings on the first stage, final norm and LM head on the last,
    rotary embeddings on every stage, layers spread evenly with the remainder on early stages), places
    the stages on the ``pp`` mesh axis as the schedule needs (one per rank; loop ``r, r + W, ...``; or V
    ``r, 2W - 1 - r``), parallelizes each stage with ``parallelize_fn`` and builds the schedule.

    Args:
        world_mesh: The dense device mesh; must have the ``pp_axis_name`` axis. Its ``pp`` sub-mesh's
            process group carries the stage-to-stage sends and receives.
        moe_mesh: The MoE mesh, handed to ``parallelize_fn`` (``None`` without experts).
        pp_axis_name, dp_axis_names, cp_axis_name, tp_axis_name, ep_axis_name, ep_shard_axis_names: Axis
            names handed to ``parallelize_fn`` (`MeshContext.pipeline_axis_kwargs` gives them).
        defer_fsdp_grad_sync: With FSDP stages: ``True`` reduce-scatters gradients once per step, after the
            last microbatch; ``False`` after every microbatch (see `automodel_pipelining._runtime`).
        device: Device of the stages' activations; default ``cuda:<current>`` on a CUDA mesh, else ``cpu``.
        dtype: Overrides ``PipelineConfig.dtype`` (activation dtype for static shapes).
        **PipelineConfig fields: ``pp_schedule``, ``pp_schedule_csv``, ``pp_microbatch_size``,
            ``pp_batch_size``, ``layers_per_stage``, ``round_virtual_stages_to_pp_multiple``,
            ``module_fqns_per_model_part``, ``balance_stages``, ``patch_inner_model``,
            ``patch_causal_lm_model``, ``patch_stage_backward_maybe_with_nosync``,
            ``scale_grads_in_schedule``, ``loss_fn``, ``pp_seq_len``; see `PipelineConfig`.

    Raises:
        ValueError: No mesh, a mesh without the pipeline axis, an invalid config field, a CSV schedule whose
            rows do not match the pipeline size, or (when the stage count is already known) too few
            microbatches for the schedule.
        FileNotFoundError: ``pp_schedule_csv`` does not exist.
    """

    def __init__(
        self,
        world_mesh: DeviceMesh | None,
        moe_mesh: DeviceMesh | None = None,
        *,
        pp_axis_name: str = "pp",
        dp_axis_names: tuple[str, ...] = ("dp",),
        cp_axis_name: str | None = None,
        tp_axis_name: str | None = None,
        ep_axis_name: str | None = None,
        ep_shard_axis_names: tuple[str, ...] | None = None,
        pp_schedule: str | None = "1f1b",
        pp_schedule_csv: str | None = None,
        pp_microbatch_size: int = 1,
        pp_batch_size: int = 1,
        layers_per_stage: int | None = None,
        round_virtual_stages_to_pp_multiple: Literal["up", "down"] | None = None,
        module_fqns_per_model_part: Sequence[Sequence[str]] | None = None,
        balance_stages: bool = False,
        patch_inner_model: bool = True,
        patch_causal_lm_model: bool = True,
        patch_stage_backward_maybe_with_nosync: bool = False,
        scale_grads_in_schedule: bool = False,
        loss_fn: Callable[..., torch.Tensor] | None = None,
        pp_seq_len: int | None = None,
        defer_fsdp_grad_sync: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        if world_mesh is None:
            raise ValueError("world_mesh must be provided (a DeviceMesh with the pipeline axis), got None")
        config = PipelineConfig(
            pp_schedule=pp_schedule,
            pp_schedule_csv=pp_schedule_csv,
            pp_microbatch_size=pp_microbatch_size,
            pp_batch_size=pp_batch_size,
            layers_per_stage=layers_per_stage,
            round_virtual_stages_to_pp_multiple=round_virtual_stages_to_pp_multiple,
            module_fqns_per_model_part=module_fqns_per_model_part,
            balance_stages=balance_stages,
            patch_inner_model=patch_inner_model,
            patch_causal_lm_model=patch_causal_lm_model,
            patch_stage_backward_maybe_with_nosync=patch_stage_backward_maybe_with_nosync,
            dtype=dtype,
            scale_grads_in_schedule=scale_grads_in_schedule,
            loss_fn=loss_fn,
            pp_seq_len=pp_seq_len,
        )
        axis_kwargs: dict[str, Any] = {
            "pp_axis_name": pp_axis_name,
            "dp_axis_names": tuple(dp_axis_names),
            "cp_axis_name": cp_axis_name,
            "tp_axis_name": tp_axis_name,
            "ep_axis_name": ep_axis_name,
            "ep_shard_axis_names": tuple(ep_shard_axis_names) if ep_shard_axis_names is not None else None,
        }
        self._setup(
            config,
            MeshContext.from_meshes(world_mesh, moe_mesh),
            axis_kwargs,
            defer_fsdp_grad_sync=defer_fsdp_grad_sync,
            device=device,
        )

    def _setup(
        self,
        config: PipelineConfig,
        mesh: MeshContext,
        axis_kwargs: dict[str, Any],
        *,
        defer_fsdp_grad_sync: bool,
        device: torch.device | str | None,
    ) -> None:
        """Validate and keep the config and the mesh as the objects they are (never rebuilt)."""
        if not isinstance(defer_fsdp_grad_sync, bool):
            raise ValueError(f"defer_fsdp_grad_sync must be a bool, got {defer_fsdp_grad_sync!r}")
        pp_axis_name = axis_kwargs["pp_axis_name"]
        if not mesh.has_axis(pp_axis_name):
            raise ValueError(
                f"world_mesh has no pipeline axis {pp_axis_name!r}; its axes are {list(mesh.axis_names())}"
            )
        self.config = config
        self._activation_dtype: torch.dtype | None = None
        self._sequence_shards = 1  # slices of the sequence between stages (sequence parallelism)
        self.mesh = mesh
        self.world_mesh = mesh.device_mesh
        self.moe_mesh = mesh.moe_mesh
        self.pp_axis_name = pp_axis_name
        self.axis_kwargs = axis_kwargs
        self.defer_fsdp_grad_sync = defer_fsdp_grad_sync
        pp_schedule = config.pp_schedule
        pp_mesh = self.mesh.submesh(pp_axis_name)
        self.pp_mesh = pp_mesh
        self.pp_size = int(pp_mesh.size())
        self.pp_rank = int(pp_mesh.get_local_rank())
        self._device = torch.device(device) if device is not None else self._default_device()
        self.spec: ScheduleSpec | None = resolve_schedule(
            self.config.pp_schedule, self.config.pp_schedule_csv
        )
        self.csv: CsvSchedule | None = None
        if self.config.pp_schedule_csv is not None:
            if pp_schedule not in (None, "1f1b"):
                warnings.warn(
                    f"pp_schedule={pp_schedule!r} is ignored: "
                    f"pp_schedule_csv={self.config.pp_schedule_csv!r} "
                    "defines the schedule",
                    stacklevel=2,
                )
            self.csv = read_csv_schedule(self.config.pp_schedule_csv, self.pp_size)
        if (
            self.config.round_virtual_stages_to_pp_multiple is not None
            and self.config.layers_per_stage is None
        ):
            warnings.warn(
                "round_virtual_stages_to_pp_multiple is ignored: it only applies with layers_per_stage",
                stacklevel=2,
            )
        known = self._stage_count_without_model()
        if known is not None:
            self._check_microbatches(known)

        self.trainable_params_before_pp: int | None = None
        self.total_params_before_pp: int | None = None
        self._seq_len: int | None = self.config.pp_seq_len
        self._parts: list[nn.Module] = []
        self._stage_ids: tuple[int, ...] = ()
        self._fqns: list[list[str]] = []
        self._stages: list[AutoPipelineStage] = []
        self._schedule: Any = None
        self._loss_fn: Callable[..., torch.Tensor] | None = None
        self._io_shapes: dict[str, Any] = {}

    @classmethod
    def from_config(
        cls,
        config: PipelineConfig,
        mesh: MeshContext,
        *,
        defer_fsdp_grad_sync: bool = True,
        device: torch.device | str | None = None,
        activation_dtype: torch.dtype | None = None,
    ) -> AutoPipeline:
        """Build from a `PipelineConfig` and a `MeshContext`, keeping both as the objects they are.

        Axis names come from `MeshContext.pipeline_axis_kwargs`. ``activation_dtype``: the dtype the
        stages' parallelization computes and sends in (a strategy's mixed precision: bf16 under the
        default FSDP2 policy over fp32 parameters), for the static shapes when ``config.dtype`` is None.

        Raises:
            ValueError: As the constructor (a mesh without the pipeline axis, bad settings).
        """
        if not isinstance(config, PipelineConfig):
            raise ValueError(f"AutoPipeline.from_config needs a PipelineConfig, got {type(config).__name__}")
        if mesh.device_mesh is None:
            raise ValueError(
                "AutoPipeline needs world_mesh, the device mesh with the pipeline axis; got None"
            )
        pipeline = cls.__new__(cls)
        pipeline._setup(
            config,
            mesh,
            mesh.pipeline_axis_kwargs(),
            defer_fsdp_grad_sync=defer_fsdp_grad_sync,
            device=device,
        )
        pipeline._activation_dtype = activation_dtype
        return pipeline

    # ------------------------------------------------------------------ properties

    def _default_device(self) -> torch.device:
        if self.mesh.device_type == "cuda":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device(self.mesh.device_type)

    @property
    def device(self) -> torch.device:
        """Device of the stages' activations."""
        return self._device

    @property
    def n_microbatches(self) -> int:
        """Microbatches per step."""
        return self.config.n_microbatches

    @property
    def num_stages(self) -> int:
        """Total number of stages over all pipeline ranks (0 before `build`)."""
        return len(self._fqns)

    @property
    def stage_ids(self) -> tuple[int, ...]:
        """The stage ids this rank runs, in increasing order."""
        return self._stage_ids

    @property
    def parts(self) -> list[nn.Module]:
        """This rank's stage modules (the model parts an optimizer trains), in stage order.

        Raises:
            RuntimeError: `build` has not been called yet (as in the reference system).
        """
        self._require_built()
        return list(self._parts)

    @property
    def schedule(self) -> Any:
        """The torch schedule (``None`` before `build`)."""
        return self._schedule

    @property
    def fqns_per_stage(self) -> list[list[str]]:
        """The module FQNs of every stage (all ranks), in stage order."""
        return [list(f) for f in self._fqns]

    @property
    def info(self) -> PipelineInfo:
        """What this rank holds: first/last stage flags, the schedule, the parts and the stages.

        Before `build`: ``PipelineInfo(enabled=False, schedule=None, has_first_stage=False,
        has_last_stage=False, model_parts=None, stages=None)``.
        """
        if self._schedule is None:
            return PipelineInfo(enabled=False, schedule=None, has_first_stage=False, has_last_stage=False)
        return PipelineInfo(
            enabled=True,
            schedule=self._schedule,
            has_first_stage=0 in self._stage_ids,
            has_last_stage=len(self._fqns) - 1 in self._stage_ids,
            model_parts=list(self._parts),
            stages=list(self._stages),
        )

    # ------------------------------------------------------------------ build

    def _stage_count_without_model(self) -> int | None:
        if self.csv is not None:
            return self.csv.num_stages
        if self.config.module_fqns_per_model_part is not None:
            return len(self.config.module_fqns_per_model_part)
        if self.config.layers_per_stage is None and self.spec is not None:
            return self.pp_size * self.spec.default_stages_per_rank
        return None

    def _check_microbatches(self, num_stages: int) -> None:
        for message in check_microbatches(
            self.spec, n_microbatches=self.n_microbatches, num_stages=num_stages, pp_size=self.pp_size
        ):
            logger.warning(message)

    def _split(self, model: nn.Module, layout: DecoderLayout) -> list[list[str]]:
        explicit = self.config.module_fqns_per_model_part
        if explicit is not None:
            modules = dict(model.named_modules())
            shared_ok = {name: next(m.parameters(), None) is None for name, m in modules.items()}
            params = [name for name, _ in model.named_parameters()]
            return check_stage_fqns(
                explicit, layout=layout, module_names=set(modules), param_names=params, shared_ok=shared_ok
            )
        if self.csv is not None:
            num_stages = self.csv.num_stages
            if num_stages > layout.num_layers:
                raise ValueError(
                    f"the CSV schedule has {num_stages} stages but the model has {layout.num_layers} layers"
                )
        else:
            assert self.spec is not None
            num_stages = calculate_virtual_stages(
                num_layers=layout.num_layers,
                pp_size=self.pp_size,
                schedule=self.spec,
                layers_per_stage=self.config.layers_per_stage,
                round_to_pp_multiple=self.config.round_virtual_stages_to_pp_multiple,
            )
        counts = None
        if self.config.balance_stages:
            counts = read_stage_costs(model, layout).layer_counts(num_stages)
        return generate_stage_fqns(layout, num_stages, counts)

    def _local_stage_ids(self, num_stages: int) -> tuple[int, ...]:
        if self.csv is not None:
            if num_stages != self.csv.num_stages:
                raise ValueError(
                    f"module_fqns_per_model_part has {num_stages} stages but the CSV schedule "
                    f"{self.csv.path!r} has {self.csv.num_stages}"
                )
            return self.csv.stages_by_rank[self.pp_rank]
        assert self.spec is not None
        if num_stages % self.pp_size:
            raise ValueError(
                f"{num_stages} stages (module_fqns_per_model_part) do not divide over pp_size={self.pp_size}"
            )
        per_rank = num_stages // self.pp_size
        if not self.spec.multi_stage and per_rank != 1:
            raise ValueError(
                f"schedule {self.spec.name!r} runs one stage per rank, but the split has {per_rank} per rank"
            )
        if self.spec.exact_stages_per_rank is not None and per_rank != self.spec.exact_stages_per_rank:
            raise ValueError(
                f"schedule {self.spec.name!r} needs exactly {self.spec.exact_stages_per_rank} stages "
                "per rank, "
                f"but the split has {per_rank}"
            )
        if self.spec.multi_stage and per_rank < 2:
            raise ValueError(f"schedule {self.spec.name!r} needs at least 2 stages per rank, got {per_rank}")
        return stage_ids_this_rank(self.pp_rank, self.pp_size, num_stages, self.spec.style)

    def _record_io_shapes(self, model: nn.Module, layout: DecoderLayout) -> None:
        params = [p for p in model.parameters() if p.is_floating_point()]
        # What flows: the configured dtype, else the strategy's compute dtype, else the parameters'.
        dtype = self.config.dtype or self._activation_dtype or (params[0].dtype if params else torch.float32)
        config = getattr(model, "config", None)
        get_text = getattr(config, "get_text_config", None)
        text = get_text() if callable(get_text) else config
        hidden = getattr(text, "hidden_size", None)
        head = model.get_submodule(layout.head) if layout.head is not None else None
        head_weight = getattr(head, "weight", None)
        width = int(head_weight.shape[0]) if isinstance(head_weight, torch.Tensor) else hidden
        self._io_shapes = {"dtype": dtype, "hidden": hidden, "last_width": width}

    def build(
        self,
        model: nn.Module,
        *,
        loss_fn: Callable[..., torch.Tensor] | None,
        parallelize_fn: ParallelizeFn | None = None,
    ) -> AutoPipeline:
        """Split ``model`` into this rank's stages, parallelize them and build the schedule.

        Preconditions: the model is a transformers decoder (``*ForCausalLM`` or a base model; peft-wrapped
        is fine), on the meta device or materialised; untied embeddings. Call on every rank of the mesh
        with identical models. Mesh axes: the ``pp`` group for stage-to-stage P2P (no collective runs here
        unless ``parallelize_fn`` runs one); ``parallelize_fn`` gets every axis name.

        Mutates: the model's own modules move into the stages (the model must not be used afterwards);
        ``parallelize_fn`` shards the stage modules in place.

        Args:
            model: The full model.
            loss_fn: ``loss_fn(logits, target) -> scalar`` computed per microbatch on the last stage;
                ``None`` uses the ``loss_fn`` given to the constructor.
            parallelize_fn: Applied to every stage module with the mesh keyword arguments.

        Returns:
            ``self``.

        Raises:
            ValueError: Unsupported model (tied embeddings, encoder-decoder, multimodal, a forward whose
                stages could not compute what it computes: `DecoderLayout.problems`), no loss
                function or two (``loss_fn`` and ``PipelineConfig.loss_fn``), an impossible split, or too
                few microbatches for the schedule.
            RuntimeError: `build` was already called.
        """
        if self._parts:
            raise RuntimeError("AutoPipeline.build was already called; create a new AutoPipeline per model")
        if loss_fn is not None and self.config.loss_fn is not None and loss_fn is not self.config.loss_fn:
            raise ValueError(
                "AutoPipeline.build got loss_fn and PipelineConfig.loss_fn is set too; give the loss once"
            )
        loss = loss_fn if loss_fn is not None else self.config.loss_fn
        if loss is None:
            raise ValueError("AutoPipeline.build needs loss_fn (the loss computed on the last stage)")
        validate_hf_model_for_pipeline_support(model)
        layout = resolve_decoder_layout(model)
        if layout.problems:
            config = getattr(model, "config", None)
            family = getattr(config, "model_type", None)
            raise ValueError(
                f"pipeline parallelism cannot split {type(model).__name__}"
                + (f" (model_type {family!r})" if family else "")
                + f": {'; '.join(layout.problems[:3])}. Each stage runs the model's own forward and receives "
                "only the previous layer's hidden states, so it could not compute what the model computes; "
                "train this model without pipeline parallelism (pp_size=1)"
            )
        fqns = self._split(model, layout)
        stage_ids = self._local_stage_ids(len(fqns))
        self._check_microbatches(len(fqns))
        self._record_io_shapes(model, layout)
        parts: list[nn.Module] = []
        for stage_id in stage_ids:
            part = build_stage_module(
                model,
                layout,
                fqns[stage_id],
                stage_index=stage_id,
                num_stages=len(fqns),
                patch_inner_model=self.config.patch_inner_model,
                patch_causal_lm_model=self.config.patch_causal_lm_model,
                # A loss that takes DTensor logits (MaskedCrossEntropy) gets them vocab-sharded under TP.
                keep_dtensor_logits=bool(getattr(loss, "accepts_dtensor_logits", False)),
            )
            if parallelize_fn is not None:
                result = parallelize_fn(
                    part, world_mesh=self.world_mesh, moe_mesh=self.moe_mesh, **self.axis_kwargs
                )
                part = result if isinstance(result, nn.Module) else part
            self._sequence_shards = share_sequence_shards(part)
            parts.append(part)
        self._fqns, self._stage_ids, self._parts, self._loss_fn = fqns, stage_ids, parts, loss
        from automodel_pipelining._runtime import warn_nested_sync_without_target

        warn_nested_sync_without_target(self.config.patch_stage_backward_maybe_with_nosync, parts)
        self._build_runtime()
        logger.info(
            "pipeline rank %d/%d: stages %s of %d, schedule %s, %d microbatches",
            self.pp_rank,
            self.pp_size,
            list(stage_ids),
            len(fqns),
            self._schedule_name(),
            self.n_microbatches,
        )
        return self

    def _schedule_name(self) -> str:
        return self.spec.name if self.spec is not None else f"csv:{self.config.pp_schedule_csv}"

    def _grad_sync_flags(self) -> tuple[bool, bool]:
        per_microbatch = not self.defer_fsdp_grad_sync
        nested = self.config.patch_stage_backward_maybe_with_nosync
        split = (
            self.spec.split_backward if self.spec is not None else bool(self.csv and self.csv.split_backward)
        )
        if split and (per_microbatch or nested):
            warnings.warn(
                f"{self._schedule_name()} splits backward into input and weight passes: FSDP gradients are "
                "reduced once after the last microbatch; defer_fsdp_grad_sync=False and "
                "patch_stage_backward_maybe_with_nosync are ignored",
                stacklevel=3,
            )
            return False, False
        return per_microbatch, nested

    def _example_io(self, stage_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        assert self._seq_len is not None
        mb, seq = self.config.pp_microbatch_size, self._seq_len
        dtype, hidden = self._io_shapes["dtype"], self._io_shapes["hidden"]
        if hidden is None:
            raise ValueError("pp_seq_len needs the model config's hidden_size for static stage shapes")
        last = len(self._fqns) - 1
        meta = torch.device("meta")
        # Sequence parallelism sends each rank's slice of the sequence between stages; the logits are whole.
        part = seq // self._sequence_shards
        # Hidden states flow both ways (activations forward, their gradients back): they require grad.
        inputs = (
            torch.empty(mb, seq, dtype=torch.long, device=meta)
            if stage_id == 0
            else torch.empty(mb, part, hidden, dtype=dtype, device=meta, requires_grad=True)
        )
        if stage_id == last:
            width = self._io_shapes["last_width"]
            return inputs, torch.empty(mb, seq, width, dtype=dtype, device=meta, requires_grad=True)
        return inputs, torch.empty(mb, part, hidden, dtype=dtype, device=meta, requires_grad=True)

    def _build_runtime(self) -> None:
        from automodel_pipelining._runtime import build_schedule, build_stages

        per_microbatch, nested = self._grad_sync_flags()
        self._stages = build_stages(
            self._parts,
            self._stage_ids,
            num_stages=len(self._fqns),
            device=self._device,
            group=self.pp_mesh.get_group(),
            example_io=self._example_io if self._seq_len is not None else None,
            reduce_grad_per_microbatch=per_microbatch,
            sync_nested_fsdp=nested,
        )
        self._schedule = build_schedule(
            self.spec,
            self._stages,
            n_microbatches=self.n_microbatches,
            loss_fn=self._loss_fn,
            scale_grads=self.config.scale_grads_in_schedule,
            csv_path=self.config.pp_schedule_csv,
        )

    # ------------------------------------------------------------------ running

    def _require_built(self) -> None:
        if self._schedule is None:
            raise RuntimeError("call AutoPipeline.build(model, loss_fn=...) before using the pipeline")

    def _check_rows(self, what: str, tensor: Any) -> None:
        if not isinstance(tensor, torch.Tensor) or tensor.dim() == 0:
            return
        rows, mb = int(tensor.shape[0]), self.config.pp_microbatch_size
        if rows % mb:
            raise ValueError(
                f"{what} has {rows} rows, which do not divide into microbatches of pp_microbatch_size={mb}"
            )
        if rows != self.config.pp_batch_size:
            raise ValueError(
                f"{what} has {rows} rows but the pipeline was built for pp_batch_size="
                f"{self.config.pp_batch_size} ({self.n_microbatches} microbatches of {mb})"
            )
        if self._seq_len is not None and tensor.dim() >= 2 and int(tensor.shape[1]) != self._seq_len:
            raise ValueError(
                f"{what} has sequence length {int(tensor.shape[1])} but the stages are shaped for "
                f"{self._seq_len}; call update_seq_len({int(tensor.shape[1])}) on every pipeline rank first"
            )

    def step(
        self,
        *args: Any,
        target: torch.Tensor | None = None,
        losses: list[torch.Tensor] | None = None,
        **kwargs: Any,
    ) -> list[torch.Tensor]:
        """Run one batch through the pipeline: forward and backward when training, forward only otherwise.

        Call on every pipeline rank with the same keyword inputs. Positional inputs (``input_ids``) are used
        where this rank has the first stage and dropped elsewhere; ``target`` is used where it has the last
        stage. Keyword tensors (``position_ids``, ``attention_mask``) are split into microbatches along dim
        0 and handed to every local stage. With gradients enabled (``torch.is_grad_enabled()``) the schedule
        runs backward and accumulates into ``.grad``; under ``torch.no_grad()`` it only evaluates (losses
        are still computed when ``target`` is given).

        Gradients are the sum of the microbatch gradients unless ``scale_grads_in_schedule`` is set (then
        their mean); call `scale_grads` afterwards for the mean with a mean-reduced ``loss_fn``.

        Args:
            *args: The first stage's inputs, usually ``input_ids`` of shape ``[pp_batch_size, seq]``.
            target: Labels for ``loss_fn`` (split along dim 0).
            losses: A list to fill with the per-microbatch losses (cleared first); a new one if ``None``.
            **kwargs: Keyword inputs of every stage.

        Returns:
            The per-microbatch losses on the rank with the last stage; an empty list elsewhere.

        Raises:
            ValueError: A batch that does not divide into microbatches or does not match ``pp_batch_size``,
                a sequence length other than the static one, no input on the first stage, or no target on
                the last stage.
            RuntimeError: Before `build`.
        """
        self._require_built()
        info = self.info
        args = args if info.has_first_stage else ()
        target = target if info.has_last_stage else None
        if info.has_first_stage and not args:
            raise ValueError("this rank runs the first stage: pass the input (e.g. input_ids) to step()")
        for index, value in enumerate(args):
            self._check_rows(f"input {index}", value)
        for name, value in kwargs.items():
            self._check_rows(name, value)
        training = torch.is_grad_enabled()
        if info.has_last_stage:
            if target is None:
                raise ValueError("this rank runs the last stage: pass target= to step() (the loss needs it)")
            self._check_rows("target", target)
        out = losses if losses is not None else []
        out.clear()
        run = self._schedule.step if training else self._schedule.eval
        # return_outputs=False: torch would otherwise keep every micro-batch's logits on the last stage
        # until the step ends and concatenate them (n_micro x tokens x vocab), for a result nobody reads.
        run(*args, target=target, losses=out if info.has_last_stage else None, return_outputs=False, **kwargs)
        return out

    def scale_grads(self, divisor: float | None = None) -> None:
        """Divide every gradient of this rank's stages by ``divisor`` (default: the microbatch count).

        After a step with ``scale_grads_in_schedule=False`` and a mean-reduced loss, this turns the summed
        microbatch gradients into the gradient of the mean loss. Local: no collective.
        """
        value = float(divisor) if divisor is not None else float(self.n_microbatches)
        if value <= 0:
            raise ValueError(f"scale_grads needs a positive divisor, got {divisor!r}")
        for part in self._parts:
            for param in part.parameters():
                if param.grad is not None:
                    param.grad.div_(value)

    def mean_loss(self, losses: Sequence[torch.Tensor]) -> torch.Tensor:
        """The mean of the per-microbatch losses, on every pipeline rank.

        Collective over the ``pp`` group (an all-reduce from the rank with the last stage).
        """
        has_last = self.info.has_last_stage
        if has_last and losses:
            value = torch.stack([loss.detach().float() for loss in losses]).mean().to(self._device)
        else:
            value = torch.zeros((), dtype=torch.float32, device=self._device)
        if self.pp_size > 1:
            dist.all_reduce(value, group=self.pp_mesh.get_group())
        return value

    def update_seq_len(self, seq_len: int) -> None:
        """Reshape the stages for sequences of ``seq_len`` tokens (static shapes from then on).

        Call on every pipeline rank before the first step with the new length. Rebuilds the torch stage and
        schedule objects; the stage modules, their parameters and gradients are kept.
        """
        if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1:
            raise ValueError(f"update_seq_len needs a positive int, got {seq_len!r}")
        self._require_built()
        if seq_len == self._seq_len:
            return
        self._seq_len = seq_len
        self._build_runtime()

    # ------------------------------------------------------------------ summaries

    def list_stage_modules(self) -> list[list[str]]:
        """The module FQNs each local stage owns, in local stage order."""
        return [list(self._fqns[s]) for s in self._stage_ids]

    def get_stage_param_counts(self, trainable_only: bool = False) -> list[int]:
        """Parameter elements per local stage (DTensors count their global size)."""
        return [count_params(part, trainable_only=trainable_only) for part in self._parts]

    def get_total_param_count(self, trainable_only: bool = False) -> int:
        """Parameter elements over this rank's stages."""
        return sum(self.get_stage_param_counts(trainable_only))

    def pretty_print_stages(self, max_modules_per_stage: int = 16, trainable_only: bool = False) -> str:
        """A readable table of this rank's stages, their modules and parameter counts.

        Args:
            max_modules_per_stage: List at most this many module FQNs per stage (then ``...``).
            trainable_only: Count trainable parameters only.

        Returns:
            The table; ``"<no stages>"`` before `build` (as in the reference system).
        """
        if self._schedule is None:
            return "<no stages>"
        header = (
            f"pipeline rank {self.pp_rank}/{self.pp_size}, schedule {self._schedule_name()}, "
            f"{self.num_stages} stages, {self.n_microbatches} microbatches"
        )
        return pretty_print_stages(
            self._stage_ids,
            self._parts,
            self.list_stage_modules(),
            header=header,
            max_modules=max_modules_per_stage,
            trainable_only=trainable_only,
        )

    def debug_summary(self) -> dict[str, Any]:
        """A JSON-friendly summary of this rank's part of the pipeline."""
        info = self.info
        return {
            "pp_rank": self.pp_rank,
            "pp_size": self.pp_size,
            "schedule": self._schedule_name(),
            "num_stages": self.num_stages,
            "stage_ids": list(self._stage_ids),
            "n_microbatches": self.n_microbatches,
            "pp_microbatch_size": self.config.pp_microbatch_size,
            "pp_batch_size": self.config.pp_batch_size,
            "seq_len": self._seq_len,
            "has_first_stage": info.has_first_stage,
            "has_last_stage": info.has_last_stage,
            "stage_modules": self.list_stage_modules(),
            "stage_param_counts": self.get_stage_param_counts(),
            "total_param_count": self.get_total_param_count(),
            "defer_fsdp_grad_sync": self.defer_fsdp_grad_sync,
            "scale_grads_in_schedule": self.config.scale_grads_in_schedule,
        }

    def log_debug_summary(self, level: int = logging.INFO) -> None:
        """Log `debug_summary` as one JSON line."""
        logger.log(level, "AutoPipeline %s", json.dumps(self.debug_summary()))


def _config_field(name: str) -> property:
    def get(self: AutoPipeline) -> Any:
        return getattr(self.config, name)

    return property(get, doc=f"``config.{name}`` (read-only).")


def _axis_name(name: str) -> property:
    def get(self: AutoPipeline) -> Any:
        return self.axis_kwargs[name]

    return property(get, doc=f"``axis_kwargs[{name!r}]`` (read-only).")


for _name in (f.name for f in fields(PipelineConfig)):
    setattr(AutoPipeline, _name, _config_field(_name))
for _name in ("dp_axis_names", "cp_axis_name", "tp_axis_name", "ep_axis_name", "ep_shard_axis_names"):
    setattr(AutoPipeline, _name, _axis_name(_name))
del _name
