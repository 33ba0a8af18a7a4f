"""Process group and DeviceMesh: the only place that knows about ranks, backends and devices."""

from __future__ import annotations

import ctypes
import ctypes.util
import math
import os
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate

from dtrain.config import MeshShape


class Parallel:
    """The mesh of a run, built once from the degrees in order (config.MESH_AXES), with its
    sub-meshes by name. One flat world mesh is unflattened into the three views a run needs, as
    torchtitan's ParallelDims does; every view lays the ranks out in the same row-major order:

    - the parameters' mesh: (dp_replicate,) fsdp, tp. `fsdp` is dp_shard × cp (named "dp_shard"
      when cp = 1): FSDP shards over every rank that holds the same weights, so optimizer states
      stay sharded over cp too;
    - the batch's: dp, cp, tp. The dp ranks (dp_replicate × dp_shard) read different rows; the cp
      ranks of one dp rank read the same rows and each keeps its part of every sequence;
    - the tokens': dp_cp, tp. Every rank holding different tokens: token counts and summed losses
      are reduced over dp_cp, once.

    - with expert parallel (ep > 1), the experts': (dp_replicate,) efsdp, ep, tp. The fsdp ranks
      split into efsdp × ep (ep innermost, as torchtitan takes it): a layer's experts are sharded
      over ep, and FSDP shards each rank's experts over efsdp (dtrain/parallel/experts.py).

    Sub-meshes: "params", "fsdp" (what fully_shard gets: 1-D, or 2-D with dp_replicate for HSDP),
    "tp", "cp", "dp" (data), "dp_cp" (tokens); with ep > 1 "experts" (the expert parameters' mesh),
    "efsdp" (what fully_shard gets for experts), "ep", "ep_tp" (the mesh experts are split on before
    FSDP: ep, or ep × tp)."""

    def __init__(self, shape: MeshShape, device: torch.device) -> None:
        self.shape, self.device = shape, device
        world = init_device_mesh(
            device.type, (math.prod(shape.degrees().values()),), mesh_dim_names=("world",)
        )
        fsdp = "dp_shard_cp" if shape.cp > 1 else "dp_shard"
        sizes, names = (shape.dp_shard * shape.cp, shape.tp), (fsdp, "tp")
        if shape.dp_replicate > 1:
            sizes, names = (shape.dp_replicate, *sizes), ("dp_replicate", *names)
        params = world._unflatten(0, sizes, names)
        batch = world._unflatten(0, (shape.dp, shape.cp, shape.tp), ("dp", "cp", "tp"))
        tokens = world._unflatten(0, (shape.dp * shape.cp, shape.tp), ("dp_cp", "tp"))
        self.meshes = {
            "params": params,
            "fsdp": params[names[:-1]] if shape.dp_replicate > 1 else params[fsdp],
            "tp": params["tp"],
            "dp": batch["dp"],
            "cp": batch["cp"],
            "dp_cp": tokens["dp_cp"],
        }
        if shape.ep > 1:
            self.meshes |= expert_meshes(world, shape)
        if params[fsdp].size() > 1 and shape.tp > 1:
            # The global grad norm is partial over both axes: with their flattening on record, DTensor
            # reduces it in one all_reduce instead of one per axis.
            params[fsdp, "tp"]._flatten(f"{fsdp}_tp")

    def __getitem__(self, name: str) -> DeviceMesh:
        return self.meshes[name]

    @property
    def mesh(self) -> DeviceMesh:
        """The parameters' mesh: every parameter is a DTensor on it (on "fsdp" alone at tp = 1), where
        FSDP shards (`sharded`); else on "tp" alone, or plain tensors at tp = 1."""
        return self.meshes["params"]

    @property
    def sharded(self) -> bool:
        """Whether FSDP has ranks to shard over (dp_replicate × dp_shard × cp > 1). Where it has none
        (one process, or tp alone) parameters are not wrapped by fully_shard, as torchtitan does:
        FSDP at one rank shards nothing and only costs (its hooks, the copies into its unsharded
        buffers and through its reduce buffer, DTensor dispatch in the optimizer)."""
        return self.meshes["fsdp"].size() > 1

    @property
    def token_group(self) -> dist.ProcessGroup:
        """Every rank of this tp rank that holds different tokens: counts and losses are summed over it."""
        return self.meshes["dp_cp"].get_group()

    @property
    def dp_rank(self) -> int:
        return self.meshes["dp"].get_local_rank()

    @property
    def dp_size(self) -> int:
        return self.shape.dp

    @property
    def cp_size(self) -> int:
        return self.shape.cp

    @property
    def tp_size(self) -> int:
        return self.shape.tp

    @property
    def ep_size(self) -> int:
        return self.shape.ep


def expert_meshes(world: DeviceMesh, shape: MeshShape) -> dict[str, DeviceMesh]:
    """The experts' views of the world (see Parallel): ep taken from the innermost fsdp ranks."""
    sizes = (shape.dp_shard * shape.cp // shape.ep, shape.ep, shape.tp)
    names = ("efsdp", "ep", "tp")
    if shape.dp_replicate > 1:
        sizes, names = (shape.dp_replicate, *sizes), ("dp_replicate", *names)
    experts = world._unflatten(0, sizes, names)
    # The experts' grad norm is partial over efsdp and ep (replicated over tp): one all_reduce
    experts["efsdp", "ep"]._flatten("efsdp_ep")
    return {
        "experts": experts,
        "efsdp": experts[names[:-2]] if shape.dp_replicate > 1 else experts["efsdp"],
        "ep": experts["ep"],
        "ep_tp": experts["ep", "tp"] if shape.tp > 1 else experts["ep"],
    }


def gather_whole(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's whole value on every rank (a plain tensor as it is), gathered one mesh axis at a
    time from the outermost (redistribute_in_steps): the all-gathers `full_tensor()` runs, in the same
    order."""
    if not isinstance(tensor, DTensor):
        return tensor
    return redistribute_in_steps(tensor, [Replicate()] * tensor.device_mesh.ndim).to_local()


def redistribute_in_steps(tensor: DTensor, placements: list) -> DTensor:
    """`tensor.redistribute(mesh, placements)` one mesh axis at a time, from the outermost. Done at
    once, a parameter that FSDP shards after tp, `(_StridedShard(dim=0), Shard(dim=0))`, cannot have
    its all-gathers merged and torch warns on every rank that the results may differ between ranks by
    reduction order; an all-gather reduces nothing, so they cannot: an axis a call, there is nothing
    to merge."""
    current = list(tensor.placements)
    for axis, placement in enumerate(placements):
        if current[axis] != placement:
            current[axis] = placement
            tensor = tensor.redistribute(tensor.device_mesh, current)
    return tensor


def world_size_from_env() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


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
    return Parallel(shape, device)


def shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
