"""Tensor parallelism across processes and hosts with JAX's own distributed runtime (multi-controller).

`--nnodes N --node-rank I --dist-init-addr HOST:PORT` (SGLang's flags, `jeagle.generate`) start one
process per host. Each calls `initialize` before any device is used: `jax.distributed.initialize`
connects it to the coordinator (rank 0 serves it at HOST:PORT), after which `jax.devices()` lists every
process's devices and the `--tp` mesh (`jeagle.parallel.sharding.make_mesh`) spans them all. `--tp`
must then equal the global device count (`check_tp`). XLA's collectives inside the executables carry
the traffic (NCCL on GPUs; on CPUs the gloo collectives, turned on here); jeagle has no transport of
its own.

Multi-controller means every process runs the same program: the same prompts, the same scheduler
steps, the same executables dispatched in the same order. A process whose scheduler decided otherwise
(admitted another group, picked another bucket or tier) would dispatch a different executable and the
collectives would never meet. The scheduler's decisions are functions of the requests, the pool and the
tokens the device returned (the same on every process: every result the host reads is replicated),
except three that read the wall clock; under nnodes > 1 each is given its timing-free setting
(`TIMING_FREE`, applied by `EngineSpec` when its `nnodes` > 1) rather than decided on one process and broadcast:

    admission gate        `admission_delay` 0: admit freed rows at once (SGLang's and vLLM's rule), not
                          when their measured idle time pays for a measured prefill call
    adaptive tiers        the `ema` policy only (accept lengths); the `throughput` policy weighs measured
                          round times and is refused
    dispatch thread       off: one thread issues every call, in program order

Sampling without a seed is the one decision made on rank 0 and broadcast (`shared_seed`, JAX's
`broadcast_one_to_all`): each process's own randomness would give the processes different inputs.
The executable store and its warm-up worker processes are already off under a mesh (`--tp` > 1,
`runtime/executables.py`): a worker process could not join the distributed runtime. The garbage
collector's clock and every other timing only feeds the stats.
"""

from __future__ import annotations

import os
import sys

from jeagle.config import ConfigError


def parse_addr(addr: str) -> tuple[str, int]:
    """HOST:PORT (a bracketed IPv6 host allowed) as (host, port); ValueError naming what is wrong."""
    host, sep, port = (addr or "").rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"--dist-init-addr must be HOST:PORT with a port in 1-65535, got {addr!r}")
    return host.strip("[]") or host, int(port)


def check(nnodes: int, node_rank: int, addr: str | None) -> str | None:
    """The first problem with the options, as a usage message, or None."""
    if nnodes < 1:
        return f"--nnodes must be >= 1, got {nnodes}"
    if not 0 <= node_rank < nnodes:
        return f"--node-rank must be in [0, {nnodes - 1}] with --nnodes {nnodes}, got {node_rank}"
    if nnodes > 1 and addr is None:
        return "--nnodes > 1 needs --dist-init-addr HOST:PORT (rank 0's address, the same on every node)"
    if addr is not None:
        try:
            parse_addr(addr)
        except ValueError as e:
            return str(e)
    return None


def native_stdout_to_stderr() -> None:
    """Send what native code writes on the process's stdout to stderr, Python's `sys.stdout` kept on the
    real stdout: gloo prints its connection notes there ("[Gloo] Rank 0 is connected to 3 peer ranks",
    from C++, unconditionally), which would land inside `--json`'s one object."""
    sys.stdout.flush()
    real = os.dup(1)
    os.dup2(2, 1)
    sys.stdout = os.fdopen(real, "w", buffering=1, encoding=sys.stdout.encoding, errors=sys.stdout.errors)


def initialize(nnodes: int, node_rank: int, addr: str) -> None:
    """Join the distributed runtime (before any device is used; blocks until every process has joined).
    On CPUs JAX's cross-process collectives need an implementation named (gloo); GPUs use NCCL whatever
    this says."""
    import jax

    host, port = parse_addr(addr)
    native_stdout_to_stderr()
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=f"{host}:{port}", num_processes=nnodes, process_id=node_rank)


def shutdown() -> None:
    """Leave the distributed runtime (a barrier: no process exits while another still runs its steps)."""
    import jax

    jax.distributed.shutdown()


def shared_seed() -> int:
    """A random seed that rank 0 draws and every process receives (JAX's `broadcast_one_to_all`): unseeded
    sampled requests would otherwise draw each process's own randomness, and the processes' replicated
    inputs would differ."""
    import numpy as np
    from jax.experimental import multihost_utils

    mine = np.asarray(np.random.default_rng().integers(0, 2**31 - 2**20), np.int32)
    return int(multihost_utils.broadcast_one_to_all(mine))


def check_tp(tp: int) -> None:
    """`--tp` must span every process's devices: each process then holds its share of the weights and KV."""
    import jax

    if tp != jax.device_count():
        raise ConfigError(f"--nnodes {jax.process_count()}: --tp must equal the devices of all the processes "
                          f"({jax.device_count()}, {jax.local_device_count()} here), got --tp {tp}")


# The engine settings whose decisions would read the wall clock, set to their timing-free values (the
# module docstring): the same decisions on every process.
TIMING_FREE = {"admission_delay": 0.0, "dispatch_thread": False}


def check_policy(adaptive) -> None:
    """Refuse the adaptive policy that decides by measured round times."""
    if adaptive is not None and adaptive.policy != "ema":
        raise ConfigError(f"--nnodes > 1: the adaptive {adaptive.policy!r} policy decides by measured times, which "
                          "differ between processes; use the 'ema' policy (the default)")


class PassChannel:
    """A server's engine commands, pass by pass, from rank 0 to the other processes (`jeagle.serve --nnodes`).

    Rank 0 serves HTTP and decides; the others follow. Each pass of rank 0's engine loop takes the commands
    that arrived (submit, abort, flush, stop) and, when it has work, steps; every other process must apply
    the same commands at the same pass and step with it. Rank 0 `send`s each pass's list (empty while it just
    steps) as one key of JAX's coordination-service key-value store (the distributed runtime's own, served by
    rank 0's coordinator: no transport of jeagle's), and each follower `receive`s pass after pass. The
    requests' inputs travel; no decision does: admission, buckets, tiers and retractions are then the same on
    every process (the module docstring). Keys live under one folder per `FOLDER` passes; a folder is deleted
    two folders later: a follower is never that far behind, as each step's collectives hold rank 0 within a
    pass or two of the slowest process."""

    PREFIX = "jeagle/serve/pass"
    FOLDER = 4096

    def __init__(self):
        from jax._src import distributed  # the client JAX's own multihost_utils uses

        self.client = distributed.global_state.client
        if self.client is None:
            raise RuntimeError("PassChannel needs jax.distributed.initialize first")
        self.sent = self.received = 0

    def _key(self, n: int) -> str:
        return f"{self.PREFIX}/{n // self.FOLDER}/{n}"

    def send(self, commands: list) -> None:
        import pickle

        n, self.sent = self.sent, self.sent + 1
        if n % self.FOLDER == 0 and n >= 2 * self.FOLDER:
            self.client.key_value_delete(f"{self.PREFIX}/{n // self.FOLDER - 2}")
        self.client.key_value_set_bytes(self._key(n), pickle.dumps(commands))

    def receive(self, poll_ms: int = 1000) -> list:
        """The next pass's commands (waits however long rank 0 sits idle; a lost coordinator raises)."""
        import pickle

        while True:
            try:
                raw = self.client.blocking_key_value_get_bytes(self._key(self.received), poll_ms)
            except Exception as e:  # JaxRuntimeError; only a timeout is waited through
                if "DEADLINE_EXCEEDED" not in str(e):
                    raise
                continue
            self.received += 1
            return pickle.loads(raw)
