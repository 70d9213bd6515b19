"""Data parallelism over devices: a 1-D mesh whose one axis splits the env batch.

Everything per-env (env state, obs, LLM hidden state, the rollout's transitions) is split along the
env axis; network params, optimizer state, PRNG key and the LLM params / prefix cache are replicated.
The trainer's jitted functions are `jax.shard_map`s over this mesh (`rl.trainer`): each device runs
its own envs with no communication, and only the PPO update talks across devices (loss means and
gradients; the reference `shuffle="global"` also all-gathers the rollout once per update). Random keys
come from global env indices, so a run on N devices equals a one-device run of the same global batch
up to float reassociation.

Multi-host: set JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES and JAX_PROCESS_ID and call
`maybe_initialize_distributed()` before touching any device; the mesh then spans every process's
devices (docs/MULTIGPU.md). Every process runs the same program on the same global arrays; host-side
decisions that could differ between processes (a time limit) go through `agree_with_main_process`,
and only the main process (`is_main_process`) writes files other than checkpoints.
"""
from __future__ import annotations

import hashlib
import os
import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

ENV_AXIS = "envs"
DISTRIBUTED_ENV_VARS = ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID")


def maybe_initialize_distributed(environ: dict[str, str] | None = None) -> bool:
    """Call `jax.distributed.initialize` when the multi-host env vars are set; True if it did.

    All three of DISTRIBUTED_ENV_VARS must be set (or none); a partial set is an error.
    """
    environ = os.environ if environ is None else environ
    present = [v for v in DISTRIBUTED_ENV_VARS if environ.get(v)]
    if not present:
        return False
    missing = [v for v in DISTRIBUTED_ENV_VARS if v not in present]
    if missing:
        raise ValueError(f"multi-host launch needs all of {', '.join(DISTRIBUTED_ENV_VARS)}; "
                         f"{', '.join(missing)} not set (see docs/MULTIGPU.md)")
    try:
        num, pid = int(environ["JAX_NUM_PROCESSES"]), int(environ["JAX_PROCESS_ID"])
    except ValueError:
        raise ValueError("JAX_NUM_PROCESSES and JAX_PROCESS_ID must be integers") from None
    if not 0 <= pid < num:
        raise ValueError(f"JAX_PROCESS_ID {pid} must be in [0, JAX_NUM_PROCESSES={num})")
    # Cross-process collectives on the CPU backend (tests, CPU-only hosts) need gloo; the flag is read only
    # when a CPU client is created, so it changes nothing for GPUs. Explicit because older jax had no default.
    if not environ.get("JAX_CPU_COLLECTIVES_IMPLEMENTATION"):
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=environ["JAX_COORDINATOR_ADDRESS"], num_processes=num,
                               process_id=pid)
    return True


def is_main_process() -> bool:
    """True in process 0 (the only one that writes config.json, metrics.jsonl and prints progress)."""
    return jax.process_index() == 0


def agree_with_main_process(flag: bool) -> bool:
    """Process 0's `flag` on every process (a collective: all processes must call it); `flag` itself
    when there is one process. For host-side decisions that must not differ between processes."""
    if jax.process_count() == 1:
        return flag
    return bool(multihost_utils.broadcast_one_to_all(np.int32(flag)))


def check_same_on_all_processes(text: str, what: str) -> None:
    """Raise ValueError on every process unless all processes passed the same `text` (a collective)."""
    if jax.process_count() == 1:
        return
    digest = np.frombuffer(hashlib.sha256(text.encode()).digest(), np.uint32)
    hashes = multihost_utils.process_allgather(digest)  # [processes, 8]
    differ = [i for i in range(hashes.shape[0]) if not np.array_equal(hashes[i], hashes[0])]
    if differ:
        raise ValueError(f"processes {differ} got another {what} than process 0; launch every process with the "
                         f"same flags (only JAX_PROCESS_ID differs)")


def resolve_device_count(requested: int) -> int:
    """`--devices` (>= 0, `TrainConfig.validate`) -> how many devices to use (0 = all visible); a clear error if
    too many."""
    visible = jax.device_count()
    if requested > visible:
        hint = ("" if jax.default_backend() != "cpu" else
                "; on CPU, XLA_FLAGS=--xla_force_host_platform_device_count=N fakes N devices")
        raise ValueError(f"--devices {requested} but only {visible} {jax.default_backend()} device(s) are "
                         f"visible; pass --devices {visible} or fewer (0 = all){hint}")
    if jax.process_count() > 1 and requested not in (0, visible):
        raise ValueError(f"with {jax.process_count()} processes the mesh must hold every process's devices: "
                         f"pass --devices 0 or --devices {visible} (got {requested})")
    return requested or visible


def make_mesh(devices: int) -> Mesh:
    """A 1-D mesh over the first `devices` devices (all processes' devices, in jax.devices() order)."""
    return Mesh(np.asarray(jax.devices()[:devices]), (ENV_AXIS,))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def env_sharded(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P(ENV_AXIS))


def keys_per_index(key: jax.Array, index: jax.Array) -> jax.Array:
    """One PRNG key per global index (`fold_in(key, i)`): the same whichever batch or device index i sits in,
    which is what makes an N-device run equal a one-device run."""
    return jax.vmap(jax.random.fold_in, in_axes=(None, 0))(key, index)


def process_local_rows(x: jax.Array) -> np.ndarray:
    """This process's rows of an array split along its first (env) axis, in global order."""
    shards = sorted(x.addressable_shards, key=lambda s: s.index[0].start or 0)
    return np.concatenate([np.asarray(s.data) for s in shards])


def from_process_local_rows(local: np.ndarray, mesh: Mesh, global_rows: int) -> jax.Array:
    """The inverse of `process_local_rows`: one global env-split array from every process's rows."""
    local = np.asarray(local)
    return jax.make_array_from_process_local_data(env_sharded(mesh), local, (global_rows,) + local.shape[1:])
