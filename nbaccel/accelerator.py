"""Accelerator: Accelerate's training front door, composed from nbaccel's smaller modules.

The states (`nbaccel.state`) know the processes and devices; `data_loader`, `optimizer`, `scheduler` and
`precision` wrap the user's objects; `checkpointing`, `tracking` and `utils.memory` save, log and free.
This class validates arguments, keeps the prepared objects, and routes each call to the module that does
the work. Names, arguments, defaults and meaning are Accelerate's.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import logging
import os
import pathlib
import re
import sys
import warnings
from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.utils.hooks
from torch.utils.data import DataLoader

from . import data_loader as _data_loader
from . import fsdp1 as _fsdp1
from . import precision as _precision
from . import sharding
from .optimizer import AcceleratedOptimizer, is_lomo
from .scheduler import AcceleratedScheduler
from .state import AcceleratorState, GradientState
from .utils import process_group_exit
from .utils import xla as _xla
from .utils.dataclasses import (
    AutocastKwargs,
    DataLoaderConfiguration,
    DistributedDataParallelKwargs,
    DistributedType,
    DynamoBackend,
    FP8BackendType,
    GradientAccumulationPlugin,
    GradScalerKwargs,
    InitProcessGroupKwargs,
    KwargsHandler,
    LoggerType,
    ProfileKwargs,
    ProjectConfiguration,
    RNGType,
    TorchDynamoPlugin,
    whole_number,
)
from .utils.imports import is_bitsandbytes_multi_backend_available, is_xpu_available
from .utils.operations import gather, gather_object, pad_across_processes, recursively_apply, reduce

_UNSET = object()  # `split_batches` given explicitly or not
_DDP_TYPES = (DistributedType.MULTI_CPU, DistributedType.MULTI_GPU, DistributedType.MULTI_NPU,
              DistributedType.MULTI_XPU, DistributedType.MULTI_MLU, DistributedType.MULTI_MUSA,
              DistributedType.MULTI_SDAA, DistributedType.MULTI_HPU, DistributedType.MULTI_NEURON)

_logger = logging.getLogger(__name__)


def _unsupported(name: str, what: str) -> ValueError:
    return ValueError(
        f"{name} was given, but nbaccel does not drive {what}: leave {name}=None (nbaccel trains with "
        "DistributedDataParallel), or run this script with Hugging Face Accelerate for that backend."
    )


def _refuse_offloaded_quantized_model(model: torch.nn.Module, distributed_type: Any) -> None:
    """A model loaded in 8-bit or 4-bit (bitsandbytes) cannot be trained spread over devices with several
    processes, nor with CPU or disk offload: raise Accelerate's ValueError before anything is moved."""
    device_map = getattr(model, "hf_device_map", None)
    if not device_map or not (getattr(model, "is_loaded_in_8bit", False) or getattr(model, "is_loaded_in_4bit", False)):
        return
    devices = {str(d) if not isinstance(d, int) else d for d in device_map.values()}
    if len(devices) > 1 and distributed_type != DistributedType.NO:
        raise ValueError("You can't train a model that has been loaded in 8-bit or 4-bit precision on multiple "
                         "devices in any distributed mode: load it on one device per process, or run one process.")
    # bitsandbytes' multi-backend build trains 8-bit/4-bit layers on the CPU (not next to an XPU)
    cpu_trains = is_bitsandbytes_multi_backend_available() and not is_xpu_available()
    if "disk" in devices or ("cpu" in devices and not cpu_trains):
        raise ValueError("You can't train a model that has been loaded in 8-bit or 4-bit precision with CPU or disk "
                         "offload: load it entirely on the accelerator (device_map={'': device}), or, to train it "
                         "on the CPU, install bitsandbytes with its multi-backend support.")


class Accelerator:
    """Prepare models, optimizers, data loaders and schedulers for the current processes, and train them."""

    def __init__(
        self,
        device_placement: bool = True,
        split_batches: bool = _UNSET,  # type: ignore[assignment]
        mixed_precision: str | None = None,
        gradient_accumulation_steps: int = 1,
        cpu: bool = False,
        dataloader_config: DataLoaderConfiguration | None = None,
        deepspeed_plugin: Any = None,
        fsdp_plugin: Any = None,
        torch_tp_plugin: Any = None,
        megatron_lm_plugin: Any = None,
        rng_types: list[str | RNGType] | None = None,
        log_with: Any = None,
        project_dir: str | os.PathLike | None = None,
        project_config: ProjectConfiguration | None = None,
        gradient_accumulation_plugin: GradientAccumulationPlugin | None = None,
        step_scheduler_with_optimizer: bool = True,
        kwargs_handlers: list[KwargsHandler] | None = None,
        dynamo_backend: DynamoBackend | str | None = None,
        dynamo_plugin: TorchDynamoPlugin | None = None,
        deepspeed_plugins: Any = None,
        parallelism_config: Any = None,
    ) -> None:
        for name, value, what in (
            ("deepspeed_plugin", deepspeed_plugin, "DeepSpeed"), ("deepspeed_plugins", deepspeed_plugins, "DeepSpeed"),
            ("megatron_lm_plugin", megatron_lm_plugin, "Megatron-LM"),
        ):
            if value is not None:
                raise _unsupported(name, what)

        # Projects, trackers
        self.project_configuration = project_config if project_config is not None else ProjectConfiguration(
            project_dir=project_dir)
        if project_dir is not None and self.project_configuration.project_dir is None:
            self.project_configuration.set_directories(project_dir)
        self.trackers: list = []
        if log_with is not None:  # unknown names, missing libraries, no directory: fail before anything starts
            from . import tracking

            self._chosen_trackers = tracking.filter_trackers(log_with, self.project_configuration.logging_dir)
            if not self._chosen_trackers:  # log_with=[] (or "all" with nothing usable): say so, as Accelerate does
                warnings.warn(f"log_with={log_with!r} selects no tracker that can run here: accelerator.log() "
                              "will record nothing. Name a tracker, or leave log_with out.", UserWarning, stacklevel=2)
        else:
            self._chosen_trackers = []
        # as Accelerate's: the trackers chosen ("all" resolved), built-in ones by their LoggerType
        self.log_with = [LoggerType(t) if isinstance(t, str) and t in LoggerType else t for t in self._chosen_trackers]

        # Precision
        # As in Accelerate, the config file reaches an Accelerator only through a launcher (its environment
        # variables): a plain `Accelerator()` in a process no launcher started takes nothing from the file.
        if mixed_precision is not None:  # the argument's exact spelling, as in Accelerate ("BF16" is refused)
            mixed_precision = _precision.validate_mixed_precision(mixed_precision, any_case=False)

        # Data loading
        if dataloader_config is None:
            dataloader_config = DataLoaderConfiguration()
        if split_batches is not _UNSET and split_batches != dataloader_config.split_batches:
            # Accelerate 1.x keeps the argument in its signature and ignores it: the same batches here, and a word
            warnings.warn(f"Accelerator(split_batches={split_batches!r}) is ignored, as in Accelerate 1.x: pass "
                          f"dataloader_config=DataLoaderConfiguration(split_batches={split_batches!r}).",
                          UserWarning, stacklevel=2)
        self.dataloader_config = dataloader_config

        # Kwargs handlers: one of each kind
        self.ddp_handler = self.scaler_handler = self.init_handler = self.autocast_handler = None
        self.fp8_recipe_handler = self.ao_recipe_handler = self.te_recipe_handler = None
        self.msamp_recipe_handler = self.profile_handler = None
        self._set_handlers(kwargs_handlers or [])
        self.has_fp8_handler = any(h is not None for h in (
            self.fp8_recipe_handler, self.ao_recipe_handler, self.te_recipe_handler, self.msamp_recipe_handler))
        self.delayed_fp8_autocast = False  # a transformer_engine option; nbaccel's fp8 runs through torchao
        self.has_lomo_optimizer = False

        # torch.compile
        if dynamo_plugin is not None and dynamo_backend is not None:
            raise ValueError("Pass dynamo_backend or dynamo_plugin, not both.")
        if dynamo_backend is None and dynamo_plugin is None:
            dynamo_plugin = TorchDynamoPlugin()  # reads NBACCEL_/ACCELERATE_DYNAMO_* set by a launcher
        if dynamo_backend is not None:
            backend = str(dynamo_backend).upper()
            if backend not in DynamoBackend:
                raise ValueError(f"Unknown dynamo_backend={dynamo_backend!r}: choose one of {DynamoBackend.list()}.")
            dynamo_plugin = TorchDynamoPlugin(backend=DynamoBackend(backend))
        self._dynamo_plugin = dynamo_plugin

        # fp8 needs an external backend: say which to install before any process group starts.
        effective = mixed_precision or _precision.validate_mixed_precision(
            _first_env("NBACCEL_MIXED_PRECISION", "ACCELERATE_MIXED_PRECISION") or "no")
        self._fp8_backend = None
        if effective == "fp8":
            self._fp8_backend = _precision.find_fp8_backend(self._preferred_fp8_backend())

        if gradient_accumulation_plugin is not None:
            if gradient_accumulation_steps != 1:
                raise ValueError(
                    "Pass gradient_accumulation_steps or gradient_accumulation_plugin, not both "
                    "(set num_steps on the plugin)."
                )
        else:
            # As in Accelerate, a launcher's setting (nbaccel launch, notebook_launcher with a saved config)
            # overrides the argument.
            from_launcher = _first_env("NBACCEL_GRADIENT_ACCUMULATION_STEPS", "ACCELERATE_GRADIENT_ACCUMULATION_STEPS")
            if from_launcher:
                if not from_launcher.strip().isdigit():
                    raise ValueError(
                        f"NBACCEL_GRADIENT_ACCUMULATION_STEPS / ACCELERATE_GRADIENT_ACCUMULATION_STEPS must be an "
                        f"integer >= 1, got {from_launcher!r}."
                    )
                gradient_accumulation_steps = int(from_launcher)
            steps = whole_number(gradient_accumulation_steps, text=True)
            if steps is None or steps < 1:
                raise ValueError(
                    f"gradient_accumulation_steps must be an integer >= 1, got {gradient_accumulation_steps!r}."
                )
            gradient_accumulation_steps = steps
            gradient_accumulation_plugin = GradientAccumulationPlugin(num_steps=gradient_accumulation_steps)
        rng_types = self._check_rng_types(rng_types)

        # States (process group, device, precision, gradient accumulation)
        init_kwargs = self.init_handler.to_kwargs() if self.init_handler is not None else {}
        cpu = bool(cpu)
        fsdp_plugin, torch_tp_plugin = sharding.default_plugins(fsdp_plugin, torch_tp_plugin)
        sharding.check_parallelism_config(parallelism_config)
        self.state = AcceleratorState(mixed_precision=mixed_precision, cpu=cpu, dynamo_plugin=dynamo_plugin,
                                      fsdp_plugin=fsdp_plugin, torch_tp_plugin=torch_tp_plugin,
                                      parallelism_config=parallelism_config, _from_accelerator=True, **init_kwargs)
        if parallelism_config is not None:
            self.state.device_mesh = parallelism_config.get_device_mesh(self.state.device.type)
        self.gradient_state = GradientState(gradient_accumulation_plugin=gradient_accumulation_plugin)

        self.device_placement = device_placement
        self.step_scheduler_with_optimizer = step_scheduler_with_optimizer
        self.native_amp = self.state.mixed_precision in ("fp16", "bf16")
        self.scaler = _precision.make_grad_scaler(
            self.state.mixed_precision, self.device.type,
            self.scaler_handler.to_kwargs() if self.scaler_handler is not None else None)
        if self.scaler is not None and self._is_fsdp1:  # fp16: skip or step on every rank alike (as Accelerate)
            self.scaler = _fsdp1.sharded_grad_scaler(self.device.type, self.scaler_handler)

        self.rng_types = rng_types
        self.step = 0
        self.flag_tensor: torch.Tensor | None = None

        # What prepare() and register_for_checkpointing() saw, for checkpoints and free_memory().
        self._models: list[torch.nn.Module] = []
        self._optimizers: list[AcceleratedOptimizer] = []
        self._schedulers: list[AcceleratedScheduler] = []
        self._dataloaders: list[DataLoader] = []
        self._custom_objects: list = []
        self._save_model_state_pre_hook: OrderedDict = OrderedDict()
        self._load_model_state_pre_hook: OrderedDict = OrderedDict()

    def _set_handlers(self, handlers: list) -> None:
        from .utils import dataclasses as _dc

        kinds = {
            DistributedDataParallelKwargs: "ddp_handler", GradScalerKwargs: "scaler_handler",
            InitProcessGroupKwargs: "init_handler", AutocastKwargs: "autocast_handler",
            _dc.FP8RecipeKwargs: "fp8_recipe_handler", _dc.AORecipeKwargs: "ao_recipe_handler",
            _dc.TERecipeKwargs: "te_recipe_handler", _dc.MSAMPRecipeKwargs: "msamp_recipe_handler",
            _dc.ProfileKwargs: "profile_handler",
        }
        seen = set()
        for handler in handlers:
            attr = kinds.get(type(handler)) or next((a for c, a in kinds.items() if isinstance(handler, c)), None)
            if attr is None:
                raise TypeError(
                    f"Unsupported kwargs handler {handler!r}: pass instances of "
                    f"{sorted(c.__name__ for c in kinds)}."
                )
            if attr in seen:
                raise ValueError(f"Only one {type(handler).__name__} may be given in kwargs_handlers.")
            seen.add(attr)
            setattr(self, attr, handler)

    def _preferred_fp8_backend(self) -> str | None:
        """The fp8 backend a recipe handler asks for (AO, TE or MSAMP), if any."""
        if self.ao_recipe_handler is not None:
            return "AO"
        if self.te_recipe_handler is not None:
            return "TE"
        if self.msamp_recipe_handler is not None:
            return "MSAMP"
        return getattr(self.fp8_recipe_handler, "backend", None)

    def _check_rng_types(self, rng_types: list | None) -> list[str]:
        if rng_types is None:
            return ["generator"]
        if isinstance(rng_types, str):  # one name (RNGType is a str too): Accelerate fails at prepare with it
            rng_types = [rng_types]
        checked = []
        for rng in rng_types:
            if str(rng) not in RNGType:
                raise ValueError(f"Unknown rng type {rng!r}: choose among {RNGType.list()}.")
            checked.append(str(rng))
        return checked

    # ------------------------------------------------------------------------------------------- properties
    @property
    def device(self) -> torch.device:
        return self.state.device

    @property
    def distributed_type(self) -> DistributedType:
        return self.state.distributed_type

    @property
    def num_processes(self) -> int:
        return self.state.num_processes

    @property
    def process_index(self) -> int:
        return self.state.process_index

    @property
    def local_process_index(self) -> int:
        return self.state.local_process_index

    @property
    def is_main_process(self) -> bool:
        return self.state.is_main_process

    @property
    def is_local_main_process(self) -> bool:
        return self.state.is_local_main_process

    @property
    def is_last_process(self) -> bool:
        return self.process_index == self.num_processes - 1

    @property
    def use_distributed(self) -> bool:
        return self.state.use_distributed

    @property
    def multi_device(self) -> bool:
        return self.use_distributed and self.distributed_type in _DDP_TYPES and self.distributed_type != "MULTI_CPU"

    @property
    def mixed_precision(self) -> str:
        return self.state.mixed_precision

    @property
    def fp8_backend(self) -> FP8BackendType:
        """The fp8 backend in use; without fp8, the launcher's --fp8_backend if any, else NO (as Accelerate)."""
        return FP8BackendType((self._fp8_backend or os.environ.get("ACCELERATE_FP8_BACKEND") or "NO").upper())

    @property
    def fp8_enabled(self) -> bool:
        return self.mixed_precision == "fp8"

    @property
    def is_fsdp2(self) -> bool:
        return self.state.is_fsdp2

    @property
    def parallelism_config(self) -> Any:
        return self.state.parallelism_config

    @property
    def torch_device_mesh(self) -> Any:
        return self.state.device_mesh

    @property
    def should_save_model(self) -> bool:
        """With data parallelism only, every replica holds the whole model: the local main process saves."""
        return self.is_local_main_process

    # Parallel ranks, as Accelerate: they need a parallelism_config (which nbaccel does not drive), so the
    # state raises RuntimeError (tensor/data parallel) or NotImplementedError (pipeline/context) saying so.
    @property
    def tensor_parallel_rank(self) -> int:
        return self.state.tensor_parallel_rank

    @property
    def pipeline_parallel_rank(self) -> int:
        return self.state.pipeline_parallel_rank

    @property
    def context_parallel_rank(self) -> int:
        return self.state.context_parallel_rank

    @property
    def data_parallel_rank(self) -> int:
        return self.state.data_parallel_rank

    @property
    def data_parallel_shard_rank(self) -> int:
        return self.state.data_parallel_shard_rank

    @property
    def is_composable_parallelism_enabled(self) -> bool:
        return self.is_fsdp2

    @property
    def deepspeed_plugin(self) -> None:
        return None

    @property
    def split_batches(self) -> bool:
        return self.dataloader_config.split_batches

    @property
    def dispatch_batches(self) -> bool | None:
        return self.dataloader_config.dispatch_batches

    @property
    def even_batches(self) -> bool:
        return self.dataloader_config.even_batches

    @even_batches.setter
    def even_batches(self, value: bool) -> None:
        self.dataloader_config.even_batches = value

    @property
    def use_seedable_sampler(self) -> bool:
        return self.dataloader_config.use_seedable_sampler

    @property
    def non_blocking(self) -> bool:
        return self.dataloader_config.non_blocking

    @property
    def use_stateful_dataloader(self) -> bool:
        return getattr(self.dataloader_config, "use_stateful_dataloader", False)

    @property
    def project_dir(self) -> str | os.PathLike | None:
        return self.project_configuration.project_dir

    @property
    def logging_dir(self) -> str | os.PathLike | None:
        return self.project_configuration.logging_dir

    @property
    def save_iteration(self) -> int:
        return self.project_configuration.iteration

    @property
    def sync_gradients(self) -> bool:
        return self.gradient_state.sync_gradients

    @sync_gradients.setter
    def sync_gradients(self, value: bool) -> None:
        self.gradient_state.sync_gradients = value

    @property
    def gradient_accumulation_steps(self) -> int:
        return self.gradient_state.num_steps

    @gradient_accumulation_steps.setter
    def gradient_accumulation_steps(self, value: int) -> None:
        self.gradient_state.plugin_kwargs.update({"num_steps": value})

    @property
    def optimizer_step_was_skipped(self) -> bool:
        """Whether the last optimizer step was skipped (fp16 overflow) on any prepared optimizer."""
        return any(optimizer.step_was_skipped for optimizer in self._optimizers)

    # ------------------------------------------------------------------------------------------- prepare
    def prepare(self, *args: Any, device_placement: list[bool | None] | None = None) -> Any:
        """Prepare every argument for this run; return them in the same order (one object when one is given).

        Models, optimizers and data loaders first, schedulers after (they refer to prepared optimizers).
        """
        if device_placement is None:
            device_placement = [None] * len(args)
        elif len(device_placement) != len(args):
            raise ValueError(
                f"device_placement has {len(device_placement)} entries for {len(args)} objects: give one per object."
            )
        for obj in args:  # before anything is prepared
            if isinstance(obj, torch.nn.Module):
                self._refuse_device_map_in_distributed(obj)
        result = list(args)
        if self.is_fsdp2:  # shards the model and re-points its optimizer before the per-object preparation
            result = sharding.prepare_fsdp2_args(result, self.state.fsdp_plugin, self.mixed_precision, self.device,
                                                 mesh=sharding.fsdp_mesh(self.torch_device_mesh, self.parallelism_config))
        elif self._is_fsdp1:  # wraps the models and re-points the optimizers given with them
            result = _fsdp1.prepare_fsdp1_args(result, self.state.fsdp_plugin, self.device)
        for index, (obj, place) in enumerate(zip(result, device_placement)):
            result[index] = self._prepare_one(obj, first_pass=True, device_placement=place)
        for index, obj in enumerate(result):
            result[index] = self._prepare_one(obj, first_pass=False)
        for obj in result:  # as Accelerate: code checks this flag to skip objects prepared already
            if any(obj is kept for kept in (*self._models, *self._optimizers, *self._dataloaders, *self._schedulers)):
                obj._is_accelerate_prepared = True
        return result[0] if len(result) == 1 else tuple(result)

    def _prepare_one(self, obj: Any, first_pass: bool, device_placement: bool | None = None) -> Any:
        if first_pass:
            if isinstance(obj, DataLoader):
                if isinstance(obj, _PREPARED_LOADERS) and not getattr(obj, "_is_accelerate_prepared", False):
                    return obj  # a loader nbaccel made (skip_first_batches' copy) is never sharded again
                return self.prepare_data_loader(obj, device_placement=device_placement)
            if isinstance(obj, torch.nn.Module):
                return self.prepare_model(obj, device_placement=device_placement)
            if isinstance(obj, torch.optim.Optimizer):
                return self.prepare_optimizer(obj, device_placement=device_placement)
        elif isinstance(obj, torch.optim.lr_scheduler.LRScheduler):
            # torch's schedulers only, as Accelerate: a scheduler of another kind is handed back as it is (its
            # code steps it on every call, and checkpoints leave it out), however much it looks like one
            return self.prepare_scheduler(obj)
        return obj

    def prepare_model(self, model: torch.nn.Module, device_placement: bool | None = None,
                      evaluation_mode: bool = False) -> torch.nn.Module:
        """Place `model` on the device, run its forward in the mixed precision, wrap it in DDP when several
        processes train, and compile it when a dynamo backend is set."""
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"prepare_model expects a torch.nn.Module, got {type(model).__name__}.")
        if getattr(model, "_is_accelerate_prepared", False) or isinstance(
                model, torch.nn.parallel.DistributedDataParallel):
            _keep(self._models, model)
            return model  # prepared already: wrapping it again would nest DDP
        self._refuse_device_map_in_distributed(model)
        _refuse_offloaded_quantized_model(model, self.distributed_type)
        if device_placement is None:
            device_placement = self.device_placement and not self.verify_device_map(model)
        model = sharding.prepare_tensor_parallel_if_asked(model, self.state, self.device)
        if self._is_fsdp1 and not evaluation_mode:
            model = _fsdp1.wrap_fsdp1(model, self.state.fsdp_plugin, self.device)
        sharded = sharding.is_sharded(model)  # FSDP2 / tensor parallel models place themselves, no DDP
        self._models.append(model)
        if device_placement and not sharded:
            model = model.to(self.device)
        if self.fp8_backend == "AO":
            model = _precision.convert_to_fp8(model, self.ao_recipe_handler)
        if self.native_amp or self.fp8_enabled:
            handler = self.autocast_handler

            def make_context(handler=handler, device_type=self.device.type, mode=self.mixed_precision):
                enabled = True if handler is None else handler.enabled
                cache = None if handler is None else handler.cache_enabled
                return _precision.autocast_context(device_type, mode, enabled, cache)

            _precision.wrap_forward(model, make_context)
        if (not evaluation_mode and not sharded and self.use_distributed and self.distributed_type in _DDP_TYPES
                and any(p.requires_grad for p in model.parameters())):
            kwargs = self.ddp_handler.to_kwargs() if self.ddp_handler is not None else {}
            kwargs = {k: v for k, v in kwargs.items() if not k.startswith("comm_")}
            if self.device.type != "cpu":
                kwargs.setdefault("device_ids", [self.device.index if self.device.index is not None else 0])
                kwargs.setdefault("output_device", kwargs["device_ids"][0])
            model = torch.nn.parallel.DistributedDataParallel(model, **kwargs)
            process_group_exit.note_group_user(model)  # end_training keeps the group while it lives
            if self.ddp_handler is not None and hasattr(self.ddp_handler, "register_comm_hook"):
                self.ddp_handler.register_comm_hook(model)
        # `_models` keeps the module itself, not its DDP or torch.compile wrapper (an FSDP1 wrapper, made
        # above, stays), as in Accelerate: save/load hooks get `_models`, and training scripts call the
        # module's own methods there (`model.save_pretrained(...)` in diffusers' save hooks)
        plugin = self._dynamo_plugin
        # compiled last, and never twice: a model the script compiled itself stays as it is (as Accelerate)
        if plugin is not None and str(getattr(plugin, "backend", "NO")).upper() != "NO" and not _is_compiled(model):
            kwargs = plugin.to_kwargs()
            kwargs = {k: v for k, v in kwargs.items() if k not in ("use_regional_compilation",)}
            kwargs["backend"] = str(kwargs.get("backend", "inductor")).lower()
            if getattr(plugin, "use_regional_compilation", False):  # each repeated block on its own
                from .utils.other import compile_regions

                model = compile_regions(model, **kwargs)
            else:
                model = torch.compile(model, **kwargs)
        model._is_accelerate_prepared = True
        return model

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer,
                          device_placement: bool | None = None) -> AcceleratedOptimizer:
        """Wrap `optimizer` so it steps only on synchronizing steps (and through the GradScaler with fp16)."""
        if isinstance(optimizer, AcceleratedOptimizer) or getattr(optimizer, "_is_accelerate_prepared", False):
            _keep(self._optimizers, optimizer)  # prepared before (and dropped by free_memory): checkpointed again
            return optimizer
        if device_placement is None:
            device_placement = self.device_placement
        self.has_lomo_optimizer |= is_lomo(optimizer)
        prepared = AcceleratedOptimizer(optimizer, device_placement=device_placement, scaler=self.scaler,
                                        device=self.device)
        self._optimizers.append(prepared)
        return prepared

    def prepare_data_loader(self, data_loader: DataLoader, device_placement: bool | None = None,
                            slice_fn_for_dispatch: Callable | None = None) -> DataLoader:
        """Shard `data_loader` across the processes and move its batches to the device."""
        if getattr(data_loader, "_is_accelerate_prepared", False):  # prepared already: keep it, do not wrap twice
            _keep(self._dataloaders, data_loader)
            return data_loader
        if device_placement is None:
            device_placement = self.device_placement
        config = self.dataloader_config
        prepared = _data_loader.prepare_data_loader(
            data_loader, self.device, num_processes=self.num_processes, process_index=self.process_index,
            split_batches=config.split_batches, put_on_device=device_placement, rng_types=list(self.rng_types),
            dispatch_batches=config.dispatch_batches, even_batches=config.even_batches,
            slice_fn_for_dispatch=slice_fn_for_dispatch, use_seedable_sampler=config.use_seedable_sampler,
            data_seed=getattr(config, "data_seed", None), non_blocking=config.non_blocking,
            use_stateful_dataloader=getattr(config, "use_stateful_dataloader", False),
        )
        self._dataloaders.append(prepared)
        return prepared

    def prepare_scheduler(self, scheduler: Any) -> AcceleratedScheduler:
        """Wrap `scheduler` so it steps with its optimizer (see `nbaccel.scheduler`)."""
        if isinstance(scheduler, AcceleratedScheduler) or getattr(scheduler, "_is_accelerate_prepared", False):
            _keep(self._schedulers, scheduler)
            return scheduler
        inner = getattr(scheduler, "optimizer", None)
        # its own prepared optimizer (the first one wrapping it); else, as Accelerate, every prepared optimizer:
        # a step one of them skipped (fp16 overflow) is not a step for the schedule either
        optimizers = next((opt for opt in self._optimizers if opt.optimizer is inner or opt is inner),
                          list(self._optimizers))
        prepared = AcceleratedScheduler(scheduler, optimizers, step_with_optimizer=self.step_scheduler_with_optimizer,
                                        split_batches=self.split_batches)
        self._schedulers.append(prepared)
        return prepared

    # ------------------------------------------------------------------------------------------- training
    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """`loss.backward()`, divided by the accumulation steps and scaled with fp16. With a prepared LOMO
        optimizer, `learning_rate=` makes it `lomo_backward` (backward and update in one pass)."""
        steps = self.gradient_state.num_steps
        if steps > 1:
            loss = loss / steps
        learning_rate = kwargs.get("learning_rate")
        if self.scaler is not None:
            self.scaler.scale(loss).backward(**kwargs)
        elif learning_rate is not None and self.has_lomo_optimizer:
            self.lomo_backward(loss, learning_rate)
        else:
            loss.backward(**kwargs)

    def _do_sync(self) -> None:
        gradient_state = self.gradient_state
        if gradient_state.sync_with_dataloader and gradient_state.end_of_dataloader:
            self.step = 0
            gradient_state._set_sync_gradients(True)
        else:
            self.step += 1
            gradient_state._set_sync_gradients(self.step % gradient_state.num_steps == 0)

    @contextlib.contextmanager
    def accumulate(self, *models: torch.nn.Module) -> Iterator[None]:
        """One micro-batch of gradient accumulation: gradients are synchronized (and the optimizer steps)
        only every `gradient_accumulation_steps` calls and at the end of the data loader."""
        self._do_sync()
        allow_sync = self.sync_gradients or (
            self.use_distributed and self.gradient_state.plugin_kwargs.get("sync_each_batch", False))
        if allow_sync or not models:
            yield
            return
        with contextlib.ExitStack() as stack:
            for model in models:
                stack.enter_context(self.no_sync(model))
            yield

    @contextlib.contextmanager
    def no_sync(self, model: torch.nn.Module) -> Iterator[None]:
        """Skip DDP's gradient all-reduce in the backward passes inside (a no-op on one process)."""
        context = getattr(model, "no_sync", None) if self.use_distributed else None
        if context is None:
            yield
        else:
            with context():
                yield

    @staticmethod
    @contextlib.contextmanager
    def trigger_sync_in_backward(model: torch.nn.Module) -> Iterator[None]:
        """Synchronize gradients in the next backward even inside `no_sync` (DDP only)."""
        if not isinstance(model, torch.nn.parallel.DistributedDataParallel):
            yield
            return
        old_grad, old_param = model.require_backward_grad_sync, model.require_forward_param_sync
        model.require_backward_grad_sync = True
        model.require_forward_param_sync = True
        model.reducer.prepare_for_backward([])
        try:
            yield
        finally:
            model.require_backward_grad_sync = old_grad
            model.require_forward_param_sync = old_param

    @contextlib.contextmanager
    def autocast(self, autocast_handler: AutocastKwargs | None = None,
                 cache_enabled: bool | None = None) -> Iterator[None]:
        """Run the block in the mixed precision (for code outside the prepared model's forward)."""
        handler = autocast_handler or self.autocast_handler
        enabled = True if handler is None else handler.enabled
        if cache_enabled is None and handler is not None:
            cache_enabled = handler.cache_enabled
        with _precision.autocast_context(self.device.type, self.mixed_precision, enabled, cache_enabled):
            yield

    def unscale_gradients(self, optimizer: Any = None) -> None:
        """Divide fp16-scaled gradients by the scale (before clipping); a no-op without fp16. As in
        Accelerate, on any step: inside an accumulation, once per optimizer step (a second call before the
        step is GradScaler's RuntimeError), so clip on synchronizing steps (`if accelerator.sync_gradients`)."""
        if self.scaler is None:
            return
        optimizers = self._optimizers if optimizer is None else (
            optimizer if isinstance(optimizer, (list, tuple)) else [optimizer])
        for opt in optimizers:
            inner = opt.optimizer if isinstance(opt, AcceleratedOptimizer) else opt
            self.scaler.unscale_(inner)

    def clip_grad_norm_(self, parameters: Any, max_norm: float, norm_type: float = 2) -> torch.Tensor:
        """`torch.nn.utils.clip_grad_norm_` after unscaling fp16 gradients; returns the total norm."""
        self.unscale_gradients()
        if self._is_fsdp1:  # FSDP1 clips over all shards itself, when given its whole model (Accelerate's rule)
            parameters = list(parameters)
            for model in self._models:
                if _fsdp1.is_fsdp1(model) and parameters == list(model.parameters()):
                    return _fsdp1.clip_grad_norm_(model, max_norm, norm_type)
        if self.is_fsdp2 or any(sharding.is_sharded(m) for m in self._models):
            return sharding.clip_grad_norm_(parameters, max_norm, norm_type=norm_type)  # DTensor gradient shards
        if self.distributed_type == DistributedType.XLA and self.num_processes > 1:
            for optimizer in self._optimizers:  # clip the replicas' mean gradient; the step will not average again
                _xla.average_gradients(optimizer.optimizer)
            self.gradient_state.is_xla_gradients_synced = True
        return torch.nn.utils.clip_grad_norm_(parameters, max_norm, norm_type=norm_type)

    def clip_grad_value_(self, parameters: Any, clip_value: float) -> None:
        """`torch.nn.utils.clip_grad_value_` after unscaling fp16 gradients."""
        self.unscale_gradients()
        torch.nn.utils.clip_grad_value_(parameters, clip_value)

    def lomo_backward(self, loss: torch.Tensor, learning_rate: float) -> None:
        """Backward and update in one pass with a LOMO/AdaLomo optimizer (package `lomo-optim`)."""
        if importlib.util.find_spec("lomo_optim") is None:
            raise ImportError("lomo_backward needs the LOMO optimizers: `pip install lomo-optim`.")
        from lomo_optim import AdaLomo, Lomo

        if learning_rate is None:
            raise ValueError("lomo_backward needs the learning rate: `accelerator.backward(loss, learning_rate=lr)`.")
        lomo = [o.optimizer for o in self._optimizers if isinstance(o.optimizer, (Lomo, AdaLomo))]
        if not lomo:
            raise ValueError("lomo_backward needs a prepared lomo_optim.Lomo or AdaLomo optimizer; none was prepared.")
        for optimizer in lomo:  # each LOMO optimizer updates its own parameters during this backward
            optimizer.fused_backward(loss, learning_rate)

    def unwrap_model(self, model: torch.nn.Module, keep_fp32_wrapper: bool = True,
                     keep_torch_compile: bool = True) -> torch.nn.Module:
        """The user's model without DDP (and, on request, without the mixed-precision forward or compile)."""
        compiled = model if _is_compiled(model) else None
        if compiled is not None:
            model = compiled._orig_mod
        while isinstance(model, (torch.nn.parallel.DistributedDataParallel, torch.nn.DataParallel)) or _fsdp1.is_fsdp1(
                model):
            model = model.module
        if not keep_fp32_wrapper:
            _precision.unwrap_forward(model)
        if compiled is not None and keep_torch_compile:
            compiled._orig_mod = model
            return compiled
        return model

    # ------------------------------------------------------------------------------------------- collectives
    def gather(self, tensor: Any) -> Any:
        """Concatenate `tensor` (or a nested structure of tensors) from every process along dim 0."""
        return gather(tensor)

    def gather_for_metrics(self, input_data: Any, use_gather_object: bool = False) -> Any:
        """Gather for evaluation: on the last batch, drop the samples `even_batches` repeated, so metrics see
        each sample of the dataset exactly once. Non-tensor data is gathered as objects."""
        if not use_gather_object and not _only_tensors(input_data):
            use_gather_object = True
        data = gather_object(input_data) if use_gather_object else gather(input_data)
        gradient_state = self.gradient_state
        if not gradient_state.end_of_dataloader:
            return data
        remainder = gradient_state.remainder
        if remainder == -1 and self.is_main_process:
            # as Accelerate's INFO record: with no length, nothing here says which samples were repeated
            _logger.info("gather_for_metrics at the last batch of a loader whose dataset has no length: the "
                         "gathered values are returned whole; drop the samples repeated to even the processes out "
                         "yourself.")
        if remainder <= 0:
            return data
        try:
            if use_gather_object:
                return data[:remainder]
            return recursively_apply(lambda t: t[:remainder], data)
        except (TypeError, IndexError):
            # Nothing to cut: a dict gathered as an object on one process, a 0-dim tensor (a loss). Returned
            # whole, as Accelerate does, rather than failing at the last batch of the evaluation.
            return data

    def reduce(self, tensor: Any, reduction: str = "sum", scale: float = 1.0) -> Any:
        """Sum (or average) `tensor` over the processes; every process gets the result."""
        if reduction not in ("sum", "mean", "none", "max", "min"):
            raise ValueError(f"reduction must be 'sum', 'mean', 'max', 'min' or 'none', got {reduction!r}.")
        return reduce(tensor, reduction, scale)

    def pad_across_processes(self, tensor: Any, dim: int = 0, pad_index: int = 0, pad_first: bool = False) -> Any:
        """Pad `tensor` along `dim` to the largest size over the processes (so it can be gathered)."""
        return pad_across_processes(tensor, dim=dim, pad_index=pad_index, pad_first=pad_first)

    def wait_for_everyone(self) -> None:
        """Barrier: every process waits here until all have arrived."""
        self.state.wait_for_everyone()

    def set_trigger(self) -> None:
        """Raise this process's flag; `check_trigger` on every process then returns True (e.g. early stop)."""
        self.flag_tensor = torch.tensor(1, device=self.device)

    def check_trigger(self) -> bool:
        """True on every process when any process called `set_trigger` since the last check (one all-reduce)."""
        if self.flag_tensor is None:
            self.flag_tensor = torch.tensor(0, device=self.device)
        flag = self.reduce(self.flag_tensor)
        if flag.item() >= 1:
            self.flag_tensor = torch.tensor(0, device=self.device)
            return True
        return False

    # ------------------------------------------------------------------------------------------- processes
    def print(self, *args: Any, **kwargs: Any) -> None:
        """print() on the local main process only."""
        self.state.print(*args, **kwargs)

    @contextlib.contextmanager
    def main_process_first(self) -> Iterator[None]:
        """The main process runs the block first, the others after it (e.g. to download or preprocess once)."""
        with self.state.main_process_first():
            yield

    @contextlib.contextmanager
    def local_main_process_first(self) -> Iterator[None]:
        """Like `main_process_first`, per machine."""
        with self.state.local_main_process_first():
            yield

    @contextlib.contextmanager
    def split_between_processes(self, inputs: Any, apply_padding: bool = False) -> Iterator[Any]:
        """This process's part of `inputs` (list, tuple, dict of lists, tensor)."""
        with self.state.split_between_processes(inputs, apply_padding=apply_padding) as part:
            yield part

    def on_main_process(self, function: Callable) -> Callable:
        """Decorator: run `function` on the main process only."""
        return self.state.on_main_process(function)

    def on_local_main_process(self, function: Callable) -> Callable:
        return self.state.on_local_main_process(function)

    def on_last_process(self, function: Callable) -> Callable:
        return self.state.on_last_process(function)

    def on_process(self, function: Callable | None = None, process_index: int | None = None) -> Callable:
        if function is None:
            return functools.partial(self.on_process, process_index=process_index)
        return self.state.on_process(function, process_index=process_index)

    def on_local_process(self, function: Callable | None = None, local_process_index: int | None = None) -> Callable:
        if function is None:
            return functools.partial(self.on_local_process, local_process_index=local_process_index)
        return self.state.on_local_process(function, local_process_index=local_process_index)

    # ------------------------------------------------------------------------------------------- data
    def skip_first_batches(self, dataloader: DataLoader, num_batches: int = 0) -> DataLoader:
        """A loader over the same data without its first `num_batches` batches (resume mid-epoch)."""
        return _data_loader.skip_first_batches(dataloader, num_batches=num_batches)

    def _refuse_device_map_in_distributed(self, model: torch.nn.Module) -> None:
        """A model dispatched over several devices (`device_map="auto"`) trains in one process only: Accelerate's
        ValueError, unless ACCELERATE_BYPASS_DEVICE_MAP (or NBACCEL_BYPASS_DEVICE_MAP) is true."""
        if self.distributed_type == DistributedType.NO or not self.verify_device_map(model):
            return
        if (_first_env("NBACCEL_BYPASS_DEVICE_MAP", "ACCELERATE_BYPASS_DEVICE_MAP") or "false").lower() == "true":
            return
        raise ValueError("You can't train a model that has been loaded with `device_map='auto'` in any distributed "
                         f"mode ({self.distributed_type.value}, {self.num_processes} processes): run one process "
                         "(`--num_processes=1`, or `python script.py`), or load the model on one device per process "
                         "(ACCELERATE_BYPASS_DEVICE_MAP=true skips this check).")

    def verify_device_map(self, model: torch.nn.Module) -> bool:
        """True when `model` was dispatched over several devices (big-model inference), which training
        must not move."""
        return any(len(getattr(m, "hf_device_map", None) or {}) > 1 for m in model.modules())

    @contextlib.contextmanager
    def join_uneven_inputs(self, joinables: list, even_batches: bool | None = None) -> Iterator[None]:
        """Train on data that gives processes different numbers of batches: DDP's `Join` shadows the
        collectives of processes that ran out. `even_batches` overrides the prepared loaders' setting inside."""
        if not (self.use_distributed and self.distributed_type in _DDP_TYPES):
            if self.distributed_type != DistributedType.NO:
                warnings.warn(f"Joining uneven inputs is only supported for multi-GPU (and multi-CPU) DDP training: "
                              f"with {self.distributed_type.value}, join_uneven_inputs has no effect.",
                              UserWarning, stacklevel=3)
            yield
            return
        from torch.distributed.algorithms.join import Join

        changed = []
        if even_batches is not None:
            if any(isinstance(loader, _data_loader.DataLoaderDispatcher)
                   or isinstance(getattr(loader, "dataset", None), torch.utils.data.IterableDataset)
                   for loader in self._dataloaders):
                warnings.warn("Overriding even_batches is only supported for map-style datasets: the prepared "
                              "loaders over iterable datasets keep their own setting.", UserWarning, stacklevel=3)
            for loader in self._dataloaders:
                sampler = getattr(loader, "batch_sampler", None)
                if isinstance(sampler, _data_loader.BatchSamplerShard):
                    changed.append((sampler, sampler.even_batches))
                    sampler.even_batches = even_batches
        if even_batches is None:
            even_batches = self.even_batches
        try:  # with even batches no process runs out early: Join (a collective per forward) stays off
            with Join(joinables, enable=not even_batches, throw_on_early_termination=False):
                yield
        finally:
            for sampler, sampler_even in changed:
                sampler.even_batches = sampler_even

    @contextlib.contextmanager
    def maybe_context_parallel(self, buffers: list | None = None, buffer_seq_dims: list | None = None,
                               no_restore_buffers: set | None = None) -> Iterator[None]:
        """Context parallelism is off in nbaccel (no parallelism_config): the block runs as written."""
        yield

    def deepspeed_ulysses_dl_adapter(self, dl: Any, model: Any) -> Any:
        raise _unsupported("deepspeed_ulysses_dl_adapter", "DeepSpeed")

    @contextlib.contextmanager
    def profile(self, profile_handler: Any = None) -> Iterator[Any]:
        """`torch.profiler.profile` configured by `ProfileKwargs` (this call's, else the Accelerator's, else the
        defaults). With an `output_trace_dir`, each process writes `profile_<process_index>.json` there (Chrome
        trace format) and the processes wait for each other; without one, no process waits, so a profile may
        run on some processes only (e.g. the main one)."""
        handler = profile_handler or self.profile_handler or ProfileKwargs()
        with handler.build() as running:
            yield running
        if handler.output_trace_dir is None:
            return
        os.makedirs(handler.output_trace_dir, exist_ok=True)
        running.export_chrome_trace(os.path.join(handler.output_trace_dir, f"profile_{self.process_index}.json"))
        self.wait_for_everyone()

    def save(self, obj: Any, f: str | os.PathLike, safe_serialization: bool = False) -> None:
        """Save `obj` once (main process; local main processes with save_on_each_node): torch.save, or
        safetensors for a dict of tensors with safe_serialization=True."""
        from .utils.other import save as _save

        on_each_node = getattr(self.project_configuration, "save_on_each_node", False)
        _save(obj, f, save_on_each_node=on_each_node, safe_serialization=safe_serialization)

    # ------------------------------------------------------------------------------------------- memory
    def free_memory(self, *objects: Any) -> list:
        """Drop the references this Accelerator holds (models, optimizers, loaders, schedulers), collect
        garbage and empty the device cache; returns `objects` released (as Accelerate: set yours to them)."""
        self._schedulers = []
        self._optimizers = []
        self._models = []
        self._dataloaders = []
        self.step = 0
        from .utils.memory import release_memory

        return release_memory(*objects)

    def clear(self, *objects: Any) -> list:
        """Alias of `free_memory`."""
        return self.free_memory(*objects)

    # ------------------------------------------------------------------------------------------- checkpoints
    def register_for_checkpointing(self, *objects: Any) -> None:
        """Save and load `objects` (anything with state_dict/load_state_dict) with save_state/load_state."""
        invalid = [f"Item at index {i} ({type(obj).__name__})" for i, obj in enumerate(objects)
                   if not (callable(getattr(obj, "state_dict", None))
                           and callable(getattr(obj, "load_state_dict", None)))]
        if invalid:
            raise ValueError(
                "register_for_checkpointing needs objects with state_dict() and load_state_dict(); these lack "
                "them: " + ", ".join(invalid)
            )
        self._custom_objects.extend(objects)

    def register_save_state_pre_hook(self, hook: Callable) -> torch.utils.hooks.RemovableHandle:
        """`hook(models, weights, output_dir)` runs in save_state before the models are written."""
        return _register_hook(self._save_model_state_pre_hook, hook)

    def register_load_state_pre_hook(self, hook: Callable) -> torch.utils.hooks.RemovableHandle:
        """`hook(models, input_dir)` runs in load_state before the models are read."""
        return _register_hook(self._load_model_state_pre_hook, hook)

    def get_state_dict(self, model: torch.nn.Module, unwrap: bool = True) -> dict:
        """The model's state dict (of the unwrapped model by default)."""
        if _fsdp1.is_fsdp1(model):  # a collective: FSDP1's full weights, gathered on the main process
            return sharding.get_full_state_dict(model, cpu_offload=True)
        if unwrap:  # a torch.compile wrapper stays, as in Accelerate: its keys start with `_orig_mod.`, on any number
            model = self.unwrap_model(model)  # of processes, and checkpoints load across both libraries
        if sharding.is_sharded(model):  # a collective: the full weights, gathered on the main process
            return sharding.get_full_state_dict(getattr(model, "_orig_mod", model) if unwrap else model, cpu_offload=True)
        from .utils.modeling import get_state_dict_offloaded_model, has_offloaded_params

        if any(has_offloaded_params(module) for module in model.modules()):
            # Offloaded weights (CPU/disk, big-model inference) are brought back one module at a time.
            return get_state_dict_offloaded_model(model)
        return model.state_dict()

    def save_model(self, model: torch.nn.Module, save_directory: str | os.PathLike,
                   max_shard_size: int | str = "10GB", safe_serialization: bool = True) -> None:
        """Write the model's weights to `save_directory` (safetensors, sharded above `max_shard_size`)."""
        from . import checkpointing

        checkpointing.save_model(self.get_state_dict(model), os.fspath(save_directory), max_shard_size=max_shard_size,
                                 safe_serialization=safe_serialization, is_main_process=self.is_main_process)

    def save_state(self, output_dir: str | os.PathLike | None = None, safe_serialization: bool = True,
                   **save_model_func_kwargs: Any) -> pathlib.Path:
        """Save everything needed to resume: models, optimizers, schedulers, loader positions, scaler, RNGs,
        registered objects. With automatic_checkpoint_naming the folder is chosen (and old ones rotated).
        Call it on every process; returns the folder."""
        from . import checkpointing

        config = self.project_configuration
        total_limit = None
        if config.automatic_checkpoint_naming:
            output_dir = checkpointing.next_checkpoint_dir(config)
            total_limit = config.total_limit
        elif output_dir is None:
            raise ValueError("save_state needs output_dir, or ProjectConfiguration(automatic_checkpoint_naming=True).")
        location = checkpointing.save_accelerator_state(
            output_dir, models=self._models, optimizers=self._optimizers, schedulers=self._schedulers,
            dataloaders=self._dataloaders, scaler=self.scaler, custom_objects=self._custom_objects,
            process_index=self.process_index, num_processes=self.num_processes,
            # Without a shared filesystem (save_on_each_node) every machine writes its own copy.
            is_main_process=self.is_local_main_process if config.save_on_each_node else self.is_main_process,
            safe_serialization=safe_serialization, step=self.step,
            pre_hooks=list(self._save_model_state_pre_hook.values()), total_limit=total_limit,
            get_state_dict=self.get_state_dict, **self._sharded_checkpoint_fns("save"),
        )
        config.iteration += 1
        return pathlib.Path(location)

    def _sharded_checkpoint_fns(self, direction: str) -> dict[str, Any]:
        """With FSDP-sharded models (FSDP1 or 2): the `{save,load}_{model,optimizer}_fn` hooks of save/load_accelerator_state
        that write/read each rank's shard through torch.distributed.checkpoint (nbaccel.utils.fsdp_utils, with
        the plugin's state_dict_type: SHARDED_STATE_DICT by default). Without sharded models: {} (the usual
        safetensors/torch.save files)."""
        from .utils import fsdp_utils

        models = [self._fsdp_checkpoint_model(m) for m in self._models]
        if not (self.distributed_type == DistributedType.FSDP and any(sharding.is_sharded(m) for m in models)):
            return {}
        plugin = self.state.fsdp_plugin

        def model_for(optimizer: Any) -> torch.nn.Module:
            inner = getattr(optimizer, "optimizer", optimizer)
            ids = {id(p) for group in inner.param_groups for p in group["params"]}
            for model in models:
                if any(id(p) in ids for p in model.parameters()):
                    return model
            raise ValueError("save_state/load_state with FSDP: an optimizer holds none of the prepared models' "
                             "parameters; pass the model and its optimizer to the same prepare() call.")

        if direction == "save":
            return {
                "save_model_fn": lambda model, directory, index: fsdp_utils.save_fsdp_model(
                    plugin, self, self._fsdp_checkpoint_model(model), directory, index),
                "save_optimizer_fn": lambda optimizer, directory, index: fsdp_utils.save_fsdp_optimizer(
                    plugin, self, optimizer, model_for(optimizer), directory, index),
            }
        kind = fsdp_utils.state_dict_kind(plugin)
        full = kind == "FULL"

        def source(directory: Any, stem: str, index: int) -> str:
            # the exact shard folder, so a checkpoint folder whose own name holds the stem is not mistaken for it
            whole = full or (kind == "LOCAL" and stem == fsdp_utils.FSDP_MODEL_NAME)  # files, not a folder
            return os.fspath(directory) if whole else os.path.join(os.fspath(directory), f"{stem}_{index}")

        def check(directory: Any) -> None:
            # every model/optimizer part is there before anything is loaded (no half-restored run)
            from . import checkpointing

            names = [fsdp_utils._weights_name(i) if full else f"{fsdp_utils.FSDP_MODEL_NAME}_{i}/.metadata"
                     for i in range(len(models))]
            if kind == "LOCAL":  # FSDP1: each rank's own model file
                names = [fsdp_utils.local_weights_name(i, self.process_index) for i in range(len(models))]
            names += [fsdp_utils._optimizer_name(i) if full else f"{fsdp_utils.OPTIMIZER_NAME}_{i}/.metadata"
                      for i in range(len(self._optimizers))]
            for name in names:
                if not os.path.isfile(os.path.join(os.fspath(directory), name)):
                    raise checkpointing.CheckpointFileMissingError(
                        f"Checkpoint {directory} has no {name}: it was not saved by save_state with FSDP and "
                        f"state_dict_type {plugin.state_dict_type.name}, or with other models/optimizers. Load it "
                        "with the plugin's state_dict_type it was saved with, and the same prepare() objects.")

        return {
            "check": check,
            "load_model_fn": lambda model, directory, index: fsdp_utils.load_fsdp_model(
                plugin, self, self._fsdp_checkpoint_model(model),
                source(directory, fsdp_utils.FSDP_MODEL_NAME, index), index),
            "load_optimizer_fn": lambda optimizer, directory, index: fsdp_utils.load_fsdp_optimizer(
                plugin, self, optimizer, model_for(optimizer),
                source(directory, fsdp_utils.OPTIMIZER_NAME, index), index),
        }

    def _fsdp_checkpoint_model(self, model: torch.nn.Module) -> torch.nn.Module:
        """The module FSDP checkpoint functions take: the FSDP1 wrapper itself, else the unwrapped model."""
        inner = getattr(model, "_orig_mod", model)
        return inner if _fsdp1.is_fsdp1(inner) else self.unwrap_model(model, keep_torch_compile=False)

    @property
    def _is_fsdp1(self) -> bool:
        return self.distributed_type == DistributedType.FSDP and not self.is_fsdp2

    def load_state(self, input_dir: str | os.PathLike | None = None, load_kwargs: dict | None = None,
                   **load_model_func_kwargs: Any) -> None:
        """Restore what save_state wrote (the latest automatic checkpoint when `input_dir` is None)."""
        from . import checkpointing

        config = self.project_configuration
        if input_dir is None:
            if not config.automatic_checkpoint_naming:
                raise ValueError("load_state needs input_dir, or ProjectConfiguration(automatic_checkpoint_naming=True).")
            input_dir = checkpointing.latest_checkpoint_dir(config)
        else:
            input_dir = os.path.expanduser(input_dir)  # "~/run/ckpt", as Accelerate reads it (save_state does not)
        load_kwargs = dict(load_kwargs or {})
        # Accelerate reads map_location among the keyword arguments; load_kwargs' is taken too
        map_location = load_model_func_kwargs.pop("map_location", None)
        map_location = load_kwargs.pop("map_location", map_location)
        sharded_fns = self._sharded_checkpoint_fns("load")
        if sharded_fns:
            sharded_fns.pop("check")(checkpointing._resolve_readable_dir(pathlib.Path(os.fspath(input_dir))))
        override = checkpointing.load_accelerator_state(
            input_dir, models=self._models, optimizers=self._optimizers, schedulers=self._schedulers,
            dataloaders=self._dataloaders, scaler=self.scaler, custom_objects=self._custom_objects,
            process_index=self.process_index, map_location=map_location, device=self.device,
            pre_hooks=list(self._load_model_state_pre_hook.values()), load_kwargs=load_kwargs,
            **sharded_fns, **load_model_func_kwargs,
        )
        if override and "step" in override:
            self.step = int(override["step"])
        # past the loaded checkpoint_<n> (a fresh process resuming saves next to it, not onto it), never back to
        # it: going back to an older checkpoint keeps the count, as Accelerate does, so no newer one is overwritten
        match = re.search(r"checkpoint_(\d+)$", os.path.basename(os.path.normpath(os.fspath(input_dir))))
        if config.automatic_checkpoint_naming and match:
            config.iteration = max(config.iteration, int(match.group(1)) + 1)

    # ------------------------------------------------------------------------------------------- trackers
    def init_trackers(self, project_name: str, config: dict | None = None, init_kwargs: dict | None = None) -> None:
        """Start the trackers of `log_with` on the main process and record `config` (hyper-parameters)."""
        from . import tracking

        if self.is_main_process:
            self.trackers.extend(tracking.init_trackers(self._chosen_trackers, project_name,
                                                        logging_dir=self.logging_dir,
                                                        config=config, init_kwargs=init_kwargs))

    def get_tracker(self, name: str, unwrap: bool = False) -> Any:
        """The tracker named `name` (its native run object with unwrap=True); a do-nothing tracker on the
        processes that have none."""
        from . import tracking

        return tracking.get_tracker(self.trackers, name, unwrap=unwrap)

    def log(self, values: dict, step: int | None = None, log_kwargs: dict | None = None) -> None:
        """Record `values` in every tracker (main process) and in the notebook dashboard (every process)."""
        from . import tracking

        tracking.log_to_trackers(self.trackers, values, step=step, log_kwargs=log_kwargs)

    def end_training(self) -> None:
        """Finish every tracker, then destroy the process group (unless the launcher that forked the processes
        owns it: FORK_LAUNCHED, as in `debug_launcher` and RankPool), as Accelerate does. Call it last, on every
        process: collectives after it raise."""
        from . import tracking

        tracking.finish_trackers(self.trackers)
        self.state.destroy_process_group()


_PREPARED_LOADERS = (_data_loader.DataLoaderShard, _data_loader.DataLoaderDispatcher)


def _register_hook(hooks: OrderedDict, hook: Callable) -> torch.utils.hooks.RemovableHandle:
    """Add `hook` to `hooks` under a new id; torch's handle (what Accelerate returns: `.remove()`, `with handle:`,
    `.id`) takes it out again."""
    handle = torch.utils.hooks.RemovableHandle(hooks)
    hooks[handle.id] = hook
    return handle


def _keep(prepared: list, obj: Any) -> None:
    """Add `obj` to one of the lists of prepared objects unless it is there (compared by identity)."""
    if not any(obj is kept for kept in prepared):
        prepared.append(obj)


def _first_env(*names: str) -> str | None:
    for name in names:
        if os.environ.get(name):
            return os.environ[name]
    return None


def _is_compiled(model: Any) -> bool:
    """Whether `model` came out of torch.compile (without importing torch._dynamo, which is slow to load)."""
    dynamo = sys.modules.get("torch._dynamo")
    return dynamo is not None and isinstance(model, dynamo.eval_frame.OptimizedModule)


def _only_tensors(data: Any) -> bool:
    """Whether `data` is tensors in (nested) lists, tuples and dicts, which `gather` can concatenate."""
    if isinstance(data, torch.Tensor):
        return True
    if isinstance(data, (list, tuple)):
        return len(data) > 0 and all(_only_tensors(item) for item in data)
    if isinstance(data, dict):
        return len(data) > 0 and all(_only_tensors(item) for item in data.values())
    return False
