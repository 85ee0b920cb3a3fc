"""rl-sglang: rollout on SGLang servers (launched or attached), optionally behind the SGLang router.

::

    from rl_sglang import SGLangGenerator

    gen = SGLangGenerator(SGLangGenerator.Config(model_path="runs/tiny", num_servers=2))
    results = await gen.generate(requests)
    await gen.update_weights(update, transport)     # disk_full, disk_delta, sglang_collective, ...
    await gen.close()

Several named server groups (one per model or role, each with its own launch options, router
and external engines) are one generator too: :class:`SGLangTopology` (``rl_sglang.topology``).

Registered as ``generator: {type: sglang}``, ``generator: {type: sglang_topology}`` and
``weight_transport: {type: sglang_collective}``.
"""

from rl_sglang.collective import SGLangCollectiveTransport, init_custom_process_group
from rl_sglang.generator import PAUSE_MODES, SGLangGenerator
from rl_sglang.server import (
    ManagedProcess,
    ServerArgs,
    launch_router,
    launch_server,
    server_argv,
)
from rl_sglang.topology import SGLangTopology
from rl_sglang.version import __version__

__all__ = [
    "PAUSE_MODES",
    "ManagedProcess",
    "SGLangCollectiveTransport",
    "SGLangGenerator",
    "SGLangTopology",
    "ServerArgs",
    "__version__",
    "init_custom_process_group",
    "launch_router",
    "launch_server",
    "server_argv",
]
