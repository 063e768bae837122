"""A real LMCache multiprocess (MP) cache server and a CPU client for it.

Owns: the harness that tests, ``kvstore demo`` and benchmarks use to drive
``python -m lmcache.v1.multiprocess.server`` on CPU: `MPServer` (the process),
`MPClient` (an engine worker's store / lookup / retrieve with flat CPU KV tensors) and
the server module behind `MPClient.wait_stored`.  Must not touch: storage logic, the
L2 adapters under test (they are only named in the server's command line).

Nothing here imports LMCache at import time except `status_module`, which only the
server loads.
"""

from kvstore.lmcache_mp.client import MPClient, MPClientError, random_kv
from kvstore.lmcache_mp.server import MPServer, MPServerError, free_port, fs_l2_adapter, plugin_l2_adapter

__all__ = [
    "MPClient",
    "MPClientError",
    "MPServer",
    "MPServerError",
    "free_port",
    "fs_l2_adapter",
    "plugin_l2_adapter",
    "random_kv",
]
