"""Process group and DeviceMesh: the only place that knows about ranks, backends and devices."""

from __future__ import annotations

import ctypes
import ctypes.util
import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from dtrain.config import MeshShape


@dataclass(frozen=True)
class Parallel:
    """The mesh and the sub-meshes each stage needs, built once per run."""

    mesh: DeviceMesh  # ("dp_shard", "tp"), or ("dp_replicate", "dp_shard", "tp") for HSDP
    dp_mesh: DeviceMesh  # what fully_shard gets: ("dp_shard",), or ("dp_replicate", "dp_shard") for HSDP
    dp_flat: DeviceMesh  # 1-D over every dp rank (replicas too): what data and the loss are split over
    tp_mesh: DeviceMesh
    device: torch.device

    @property
    def dp_group(self) -> dist.ProcessGroup:
        """The group of all dp ranks of this tp rank: token counts and losses are summed over it."""
        return self.dp_flat.get_group()

    @property
    def dp_rank(self) -> int:
        return self.dp_flat.get_local_rank()

    @property
    def dp_size(self) -> int:
        return self.dp_flat.size()

    @property
    def tp_size(self) -> int:
        return self.tp_mesh.size()


def rank_from_env() -> int:
    return int(os.environ.get("RANK", "0"))


def device_for_this_process() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


# glibc's mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3


def keep_freed_host_memory() -> None:
    """Training on the CPU: keep glibc from handing a step's large buffers back to the kernel and
    faulting them in again, page by page, in the next step. Blocks of 32 MiB and more (logits, their
    gradient) are otherwise mmapped afresh each time: 35 % of a CPU step of the bench model. Freed
    memory stays in the process for reuse, as CUDA's caching allocator keeps device memory. Speed
    only, never results; without glibc's mallopt (macOS, musl) nothing changes."""
    try:
        mallopt = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").mallopt
    except (OSError, AttributeError):
        return
    mallopt(_M_MMAP_THRESHOLD, 1 << 30)  # serve blocks up to 1 GiB from the heap, not fresh mmaps
    mallopt(_M_TRIM_THRESHOLD, 2**31 - 1)  # and never shrink the heap under them


def init_distributed(timeout_s: int) -> torch.device:
    """Start the default process group once per process (a Hydra sweep reuses it for every job)."""
    device = device_for_this_process()
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:
        keep_freed_host_memory()
    if dist.is_initialized():
        return device
    backend = "nccl" if device.type == "cuda" else "gloo"
    timeout = timedelta(seconds=timeout_s)
    device_id = device if backend == "nccl" else None
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        # torchrun's store outlives a worker restart (--max-restarts): keys of the dead attempt,
        # such as its gloo addresses, would be read by the new one. Give each attempt its own.
        store = dist.TCPStore(
            os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=timeout
        )
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        dist.init_process_group(
            backend,
            store=dist.PrefixStore(f"dtrain/attempt_{attempt}", store),
            rank=int(os.environ["RANK"]),
            world_size=int(os.environ["WORLD_SIZE"]),
            timeout=timeout,
            device_id=device_id,
        )
    elif "MASTER_ADDR" in os.environ:
        dist.init_process_group(backend, timeout=timeout, device_id=device_id)
    else:  # plain `python -m dtrain.sft`: one process, no rendezvous needed
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    return device


def build_parallel(shape: MeshShape, device: torch.device) -> Parallel:
    """The named mesh. With dp_replicate > 1 (HSDP) FSDP shards over the 2-D ("dp_replicate",
    "dp_shard") sub-mesh, and the data over its flattening "dp"."""
    if shape.dp_replicate > 1:
        mesh = init_device_mesh(
            device.type,
            (shape.dp_replicate, shape.dp_shard, shape.tp),
            mesh_dim_names=("dp_replicate", "dp_shard", "tp"),
        )
        dp_mesh = mesh["dp_replicate", "dp_shard"]
        # A 2-D mesh has no single group; torchtitan flattens it the same way.
        dp_flat = dp_mesh._flatten("dp")
    else:
        mesh = init_device_mesh(device.type, (shape.dp_shard, shape.tp), mesh_dim_names=("dp_shard", "tp"))
        dp_mesh = dp_flat = mesh["dp_shard"]
    if shape.dp_shard > 1 and shape.tp > 1:
        # The global grad norm is partial over both axes: with their flattening on record, DTensor
        # reduces it in one all_reduce instead of one per axis.
        mesh["dp_shard", "tp"]._flatten("dp_shard_tp")
    return Parallel(mesh=mesh, dp_mesh=dp_mesh, dp_flat=dp_flat, tp_mesh=mesh["tp"], device=device)


def shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
