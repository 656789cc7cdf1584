"""`ParallelismConfig`: how the processes split into data-parallel replicas, FSDP shards and tensor-parallel
groups, as one torch DeviceMesh (Accelerate's class, names and mesh layout).

`ParallelismConfig(dp_shard_size=2, tp_size=2)` on 4 processes gives a 2x2 mesh with dimensions
("dp_shard", "tp"); the Accelerator builds it (`build_device_mesh`) and the states report
`tensor_parallel_rank`, `data_parallel_rank`, `data_parallel_shard_rank` from it. Sizes left unset come from
PARALLELISM_CONFIG_* environment variables (set by the launcher from the config file), else 1.
Context and sequence parallelism (cp_size/sp_size > 1) are not implemented by nbaccel and are refused.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

_MESH_ORDER = ("dp_replicate", "dp_shard", "cp", "sp", "tp")


def _size(name: str, value: int | None) -> int:
    if value is None:
        value = int(os.environ.get(f"PARALLELISM_CONFIG_{name.upper()}", "1"))
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    return value


@dataclass
class ParallelismConfig:
    """Sizes of each parallelism dimension; their product is the number of processes used."""

    dp_replicate_size: int | None = None
    dp_shard_size: int | None = None
    tp_size: int | None = None
    cp_size: int | None = None
    cp_backend: str | None = None
    sp_size: int | None = None
    sp_backend: str | None = None
    tp_handler: Any = None
    cp_handler: Any = None
    sp_handler: Any = None
    device_mesh: Any = field(default=None, repr=False)

    def __post_init__(self) -> None:
        self.dp_replicate_size = _size("dp_replicate_size", self.dp_replicate_size)
        self.dp_shard_size = _size("dp_shard_size", self.dp_shard_size)
        self.tp_size = _size("tp_size", self.tp_size)
        self.cp_size = _size("cp_size", self.cp_size)
        self.sp_size = _size("sp_size", self.sp_size)
        self.cp_backend = self.cp_backend or os.environ.get("PARALLELISM_CONFIG_CP_BACKEND", "torch")
        self.sp_backend = self.sp_backend or os.environ.get("PARALLELISM_CONFIG_SP_BACKEND", "deepspeed")
        # each dimension in use gets its settings object (defaults, or read from the environment)
        if self.tp_size > 1 and self.tp_handler is None:
            self.tp_handler = TorchTensorParallelConfig()
        if self.cp_size > 1 and self.cp_handler is None:
            self.cp_handler = TorchContextParallelConfig()
        elif self.cp_size > 1 and not isinstance(self.cp_handler, TorchContextParallelConfig):
            raise ValueError(f"cp_backend={self.cp_backend!r} takes a TorchContextParallelConfig as cp_handler, "
                             f"got {type(self.cp_handler).__name__}.")
        if self.sp_size > 1 and self.sp_handler is None:
            self.sp_handler = DeepSpeedSequenceParallelConfig()
        if self.tp_size > 1 and self.dp_replicate_size > 1 and self.dp_shard_size == 1:
            raise ValueError(
                "Tensor parallelism (tp_size > 1) cannot be combined with pure data parallelism (dp_replicate_size > "
                "1 and dp_shard_size == 1): set dp_shard_size > 1 for FSDP + TP, or dp_replicate_size == 1."
            )
        self._sizes = {"dp_replicate": self.dp_replicate_size, "dp_shard": self.dp_shard_size,
                       "cp": self.cp_size, "sp": self.sp_size, "tp": self.tp_size}

    # --- which dimensions are on ------------------------------------------------------------------------
    @property
    def dp_replicate_enabled(self) -> bool:
        return self.dp_replicate_size > 1

    @property
    def dp_shard_enabled(self) -> bool:
        return self.dp_shard_size > 1

    @property
    def tp_enabled(self) -> bool:
        return self.tp_size > 1

    @property
    def cp_enabled(self) -> bool:
        return self.cp_size > 1

    @property
    def sp_enabled(self) -> bool:
        return self.sp_size > 1

    @property
    def dp_dim_names(self) -> list[str]:
        return [n for n, on in (("dp_replicate", self.dp_replicate_enabled), ("dp_shard", self.dp_shard_enabled)) if on]

    @property
    def non_dp_dim_names(self) -> list[str]:
        return [n for n, on in (("tp", self.tp_enabled), ("cp", self.cp_enabled), ("sp", self.sp_enabled)) if on]

    @property
    def dp_shard_cp_dim_names(self) -> list[str]:
        return [n for n, on in (("dp_shard", self.dp_shard_enabled), ("cp", self.cp_enabled)) if on]

    @property
    def dp_cp_dim_names(self) -> list[str]:
        return self.dp_dim_names + (["cp"] if self.cp_enabled else [])

    @property
    def fsdp_dim_names(self) -> list[str]:
        return (["dp_replicate"] if self.dp_replicate_enabled else []) + ["dp_shard_cp"]

    @property
    def active_mesh_dims(self) -> list[str]:
        return self.dp_dim_names + self.non_dp_dim_names

    @property
    def total_size(self) -> int:
        return self.dp_replicate_size * self.dp_shard_size * self.tp_size * self.cp_size * self.sp_size

    @property
    def non_data_parallel_size(self) -> int:
        return self.tp_size * self.cp_size * self.sp_size

    @property
    def data_parallel_size(self) -> int:
        return self.dp_replicate_size * self.dp_shard_size

    # --- the mesh -----------------------------------------------------------------------------------------
    def _get_mesh(self) -> tuple[tuple[str, ...], tuple[int, ...]]:
        dims = sorted(self.active_mesh_dims, key=_MESH_ORDER.index)
        return tuple(dims), tuple(self._sizes[d] for d in dims)

    def build_device_mesh(self, device_type: str):
        """Create the DeviceMesh (and the flattened "dp", "dp_shard_cp", "dp_cp" views) over all processes."""
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        names, shape = self._get_mesh()
        if not names:
            return None
        world = dist.get_world_size() if dist.is_initialized() else 1
        mismatch = ValueError(
            f"ParallelismConfig sizes multiply to {self.total_size} ({dict(zip(names, shape))}) but there are "
            f"{world} processes: make the product equal the number of processes."
        )
        if self.total_size < world:  # torch would build a mesh that leaves processes out
            raise mismatch
        try:
            mesh = init_device_mesh(device_type, shape, mesh_dim_names=names)
        except (RuntimeError, ValueError) as error:  # a larger product: torch refuses it; say why
            if self.total_size == world:
                raise
            raise mismatch from error
        for flat, dims in (("dp", self.dp_dim_names), ("dp_shard_cp", self.dp_shard_cp_dim_names),
                           ("dp_cp", self.dp_cp_dim_names)):
            if dims:
                mesh[list(dims)]._flatten(flat)
        return mesh

    def get_device_mesh(self, device_type: str | None = None):
        """The mesh, built on first use for `device_type`."""
        if self.device_mesh is None:
            if device_type is None:
                raise ValueError("get_device_mesh needs a device_type (e.g. 'cuda' or 'cpu') to build the mesh.")
            self.device_mesh = self.build_device_mesh(device_type)
        elif device_type is not None and self.device_mesh.device_type != device_type:
            raise ValueError(f"The device mesh was built for {self.device_mesh.device_type!r}, not {device_type!r}.")
        return self.device_mesh

    def to_json(self) -> dict[str, Any]:
        return {"dp_replicate_size": self.dp_replicate_size, "dp_shard_size": self.dp_shard_size,
                "tp_size": self.tp_size, "cp_size": self.cp_size, "cp_backend": self.cp_backend,
                "sp_size": self.sp_size, "sp_backend": self.sp_backend}


# --- the per-dimension configs of Accelerate's ParallelismConfig (tp_handler, cp_handler, sp_handler) ------
@dataclass
class TorchTensorParallelConfig:
    """Tensor-parallel settings: `enable_async_tp` overlaps the TP collectives with compute (torch's async TP)."""

    enable_async_tp: bool = False


@dataclass
class TorchContextParallelConfig:
    """Context-parallel settings: `cp_comm_strategy` "allgather" (default, or $PARALLELISM_CONFIG_CP_COMM_STRATEGY)
    or "alltoall"."""

    cp_comm_strategy: str | None = None

    def __post_init__(self) -> None:
        if self.cp_comm_strategy is None:
            self.cp_comm_strategy = os.environ.get("PARALLELISM_CONFIG_CP_COMM_STRATEGY", "allgather")
        if self.cp_comm_strategy not in ("allgather", "alltoall"):
            raise ValueError(f"Invalid cp_comm_strategy: {self.cp_comm_strategy} (use 'allgather' or 'alltoall').")


_SP_ATTENTION = ("flash_attention_2", "flash_attention_3", "sdpa")


@dataclass
class DeepSpeedSequenceParallelConfig:
    """DeepSpeed (ALST/Ulysses) sequence-parallel settings. Each field left None reads its
    PARALLELISM_CONFIG_SP_* variable; a fixed length (`sp_seq_length_is_variable=False`) needs `sp_seq_length`."""

    sp_seq_length: int | None = None
    sp_seq_length_is_variable: bool | None = None
    sp_attn_implementation: str | None = None

    def __post_init__(self) -> None:
        if self.sp_seq_length_is_variable is None:
            self.sp_seq_length_is_variable = (
                os.environ.get("PARALLELISM_CONFIG_SP_SEQ_LENGTH_IS_VARIABLE", "true").lower() == "true")
        if not self.sp_seq_length_is_variable and self.sp_seq_length is None:
            from_env = os.environ.get("PARALLELISM_CONFIG_SP_SEQ_LENGTH")
            if from_env is None:
                raise ValueError("sp_seq_length_is_variable=False needs sp_seq_length (or "
                                 "PARALLELISM_CONFIG_SP_SEQ_LENGTH)")
            self.sp_seq_length = None if from_env == "None" else int(from_env)
        if self.sp_attn_implementation is None:
            self.sp_attn_implementation = os.environ.get("PARALLELISM_CONFIG_SP_ATTN_IMPLEMENTATION")
        chosen = self.sp_attn_implementation
        if chosen is not None and chosen not in _SP_ATTENTION and not ("/" in chosen and "flash-attn" in chosen):
            raise ValueError(f"sp_attn_implementation must be one of {', '.join(_SP_ATTENTION)} or a hub flash "
                             f"attention kernel such as 'kernels-community/flash-attn2', got {chosen!r}")
