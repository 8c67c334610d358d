"""Start-up work that overlaps the rest of a start: the devices come up on a thread while Python imports.

A start spends its first seconds importing JAX, Flax and jeagle and reading the tokenizer (the GIL
held throughout) and bringing the devices up: the backend's initialisation and, on a GPU, the
allocator's first allocation, which with JAX's default preallocation maps most of the GPU's memory
(about 0.45 s and 1.1 s on an H100; the GIL released). `warm_devices()` starts the second on a thread
so that the two overlap; the main thread's first use of a device then finds it ready, or waits for it.

Nothing changes but when the devices come up. JAX (and NumPy) are imported on the calling thread
before the thread starts: two threads importing NumPy's C extension at once can see it half
initialised ("cannot import name '__cpu_features__'"). An error the thread meets is the main
thread's to meet again at its own first use of the device (it raises there, as it would have);
`join()` before the interpreter exits, so that no thread is still inside the backend while it shuts
down.
"""

from __future__ import annotations

import os
import threading

ALLOCATOR_VARIABLES = ("XLA_PYTHON_CLIENT_PREALLOCATE", "XLA_PYTHON_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_ALLOCATOR")


def on_demand_allocation() -> bool:
    """Unless the user set one of JAX's allocator variables, turn its preallocation off for this
    process (before the backend starts): by default JAX maps 75% of the GPU's memory at the first
    allocation, about 2.0 s on an H200 (0.004 s without; `bench/probes/device_init.py`), which a
    one-shot command pays on its critical path. The engine's KV pool is one allocation of its own
    size either way, and the steps' buffers come from the same caching allocator once it has grown.
    Returns whether it changed the setting. A server keeps the preallocation (`jeagle.serve`)."""
    if any(v in os.environ for v in ALLOCATOR_VARIABLES):
        return False
    os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
    return True


class DeviceWarmup:
    """The devices' set-up, running on a daemon thread from construction."""

    def __init__(self):
        import jax  # noqa: F401 - here, not first on the thread (see above)
        import numpy  # noqa: F401

        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="jeagle-device-warmup", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            import jax
            import numpy as np

            # The backend, then one small buffer on each local device: its allocator's first allocation.
            jax.block_until_ready([jax.device_put(np.zeros((), np.float32), d) for d in jax.local_devices()])
        except BaseException as e:  # noqa: BLE001 - the main thread meets it again at its first use
            self.error = e

    def join(self, timeout: float | None = None) -> None:
        self._thread.join(timeout)


def warm_devices() -> DeviceWarmup:
    return DeviceWarmup()
