"""The ``ray`` runtime: policy ranks and generators as Ray actors in a placement group.

The loop (:mod:`rl_trainer.loop`) is the same as on the ``local`` runtime; only where the
components live and how weights move differ. The driver keeps the data, buffer, rewards and the
schedule; the heavy parts run in actors and are reached through proxies that satisfy the same
interfaces::

    driver (Trainer)                          Ray actors (one placement group)
    RayPolicy    (Policy)    ── SPMD calls ──> PolicyRank x N   (policy + reference, sender)
    RayGeneratorPool (Generator) ─ chunks ──> GeneratorEngine x M (generator + receiver)
    weights: rank 0 publishes through a cross-process WeightTransport (disk_full, disk_delta,
             or broadcast: a collective group of rank 0 and the engines, re-formed on every
             engine restart; :mod:`~rl_trainer.ray.collective`); every engine applies the
             update with its own receiver.

Layouts (``runtime.layout``): ``disaggregated`` gives every actor its own bundle;
``colocated`` puts generator ``i`` into the bundle of policy rank ``i`` and, in the synchronous
loop, releases the generator's memory while the policy trains when the backend supports it.

Failures: a generator engine that dies or runs past ``runtime.generate_timeout_s`` is killed,
its requests are retried on another engine (same weights, same per-request seeds), and it is
restarted in its bundle from the newest published checkpoint (with ``broadcast``: re-synced by a
new generation of the group), so it serves the current version before it takes work again. A policy rank that dies or times out stops the run with an
:class:`~rl_core.errors.RLError`; the newest checkpoint resumes it (``--resume``).

Modules, one per role: :mod:`~rl_trainer.ray.config` (recipe checks and shared helpers),
:mod:`~rl_trainer.ray.policy` (policy ranks and their driver-side proxies),
:mod:`~rl_trainer.ray.generator` (generator engines and the pool over them),
:mod:`~rl_trainer.ray.collective` (the ``broadcast`` group and its re-formation),
:mod:`~rl_trainer.ray.colocation` (memory hand-over in the colocated layout) and
:mod:`~rl_trainer.ray.runtime` (the runtime that creates and owns them).
"""

from rl_trainer.ray.config import check_ray_config
from rl_trainer.ray.generator import GeneratorEngine, RayGeneratorPool
from rl_trainer.ray.policy import PolicyRank, RayCritic, RayPolicy, RemoteWeights
from rl_trainer.ray.runtime import RayRuntime

__all__ = [
    "GeneratorEngine",
    "PolicyRank",
    "RayCritic",
    "RayGeneratorPool",
    "RayPolicy",
    "RayRuntime",
    "RemoteWeights",
    "check_ray_config",
]
