"""How the fused kernels address a peer: `Remote` (one device per member of a mesh axis,
inside `jax.shard_map`: remote refs and semaphores signalled on the peer) and `Loopback`
(P virtual devices on one GPU as P groups of programs of one kernel: a peer's buffer is a
slice of one (P, …) buffer, the semaphores one global array), so the protocol, tile math
and stores are checkable on one GPU. `signal_released` is the signal both use."""
from __future__ import annotations

import dataclasses

from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu


def signal_released(signals):
    """Increment each (semaphore, device_id) of `signals` by 1 with release semantics
    (red.release.sys after a warpgroup barrier): called once the stores it announces have
    landed, so the peer that acquires the count sees them. Not
    `plgpu.semaphore_signal_parallel`: its increment is relaxed and its release fence comes
    after it, which does not order the stores before the signal."""
    for sem, device_id in signals:
        pl.semaphore_signal(sem, 1, device_id=device_id)


@dataclasses.dataclass(frozen=True)
class Remote:
    """One device per member of mesh axis `axis` (inside shard_map)."""
    axis: str
    p: int
    nprog: int

    devices_here = 1

    def grid(self):
        return self.nprog

    def ids(self):
        return lax.axis_index(self.axis), lax.axis_index("prog")

    def local(self, ref, me):
        return ref

    def peer(self, ref, me, dst):
        return plgpu.remote_ref(ref, {self.axis: dst})

    def semaphores(self, scratch, me, b):
        return scratch

    def signal(self, sems, me, b, dsts, phase=0):
        signal_released([(sems.at[phase * self.p + me], {self.axis: d}) for d in dsts])

    def wait(self, sems, me, b, src, phase=0):
        pl.semaphore_wait(sems.at[phase * self.p + src], 1)


@dataclasses.dataclass(frozen=True)
class Loopback:
    """P virtual devices on this GPU: device d is programs d·nprog … (d+1)·nprog − 1;
    `phases` handshakes per program (one semaphore per (phase, receiver, sender, program))."""
    p: int
    nprog: int
    phases: int = 1

    @property
    def devices_here(self):
        return self.p

    def grid(self):
        return self.p * self.nprog

    def ids(self):
        g = lax.axis_index("prog")
        return g // self.nprog, g % self.nprog

    def local(self, ref, me):
        return ref.at[me]

    def peer(self, ref, me, dst):
        return ref.at[dst]

    def semaphores(self, scratch, me, b):
        # global: they persist between calls, and every signal is consumed by one wait
        return pl.get_global(plgpu.SemaphoreType.REGULAR(
            (self.phases * self.p * self.p * self.nprog,)))

    def _sem(self, sems, dst, src, b, phase):
        return sems.at[((phase * self.p + dst) * self.p + src) * self.nprog + b]

    def signal(self, sems, me, b, dsts, phase=0):
        signal_released([(self._sem(sems, d, me, b, phase), None) for d in dsts])

    def wait(self, sems, me, b, src, phase=0):
        pl.semaphore_wait(self._sem(sems, me, src, b, phase), 1)
