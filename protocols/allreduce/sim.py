"""allreduce's workers in the simulator: lock-step, no coordinator per iteration."""

from __future__ import annotations

from ripples.coordinator.decisions import GroupDecision
from ripples.sim.models import shared_finish_times
from ripples.sim.worker_model import SimulatedWorkers, SimWorker


class LockstepWorkers(SimulatedWorkers):
    """Iteration k ends when the slowest worker computed it and the ring all-reduce over
    every worker is done; every model is then the average (DDP's arithmetic)."""

    def run(self) -> str:
        sim = self.sim
        cfg = sim.config
        n = cfg.workers
        spans = n > cfg.workers_per_host
        ring = sim.comm.allreduce_seconds(n, spans_hosts=spans)
        sample_every = sim.sample_interval()
        next_sample = 0.0
        cores = cfg.compute.cores
        for _ in range(cfg.iterations):
            draws = [sim.compute_times.draw(w.rank) for w in sim.workers]
            took = (shared_finish_times([work for work, _ in draws], cores) if cores
                    else [work for work, _ in draws])
            times = [t * factor for t, (_, factor) in zip(took, draws, strict=True)]
            slowest = max(times)
            # Shared cores: the ring's n threads share them too.
            collective = ring * max(1.0, n / cores) if cores else ring
            for w, t in zip(sim.workers, times, strict=True):
                w.compute_s += t
                w.wait_s += slowest - t
                w.comm_s += collective
                w.iteration += 1
            sim.now += slowest + collective
            sim.events += 1
            for r in range(n):
                sim.model.step(r)
            sim.model.set_all_to_mean()
            if sim.now >= next_sample:
                sim.curve.append((sim.now, sim.model.distance()))
                next_sample = sim.now + sample_every
        return f"iteration budget reached ({cfg.iterations * n} iterations)"

    # The run above never hands an event to these: lock-step workers ask no coordinator.
    def on_compute(self, w: SimWorker) -> None:
        raise AssertionError("lock-step workers run in run()")

    def poll_seconds(self, w: SimWorker) -> float:
        raise AssertionError("lock-step workers ask the coordinator for no group")

    def on_decision(self, w: SimWorker, decision: GroupDecision) -> None:
        raise AssertionError("lock-step workers ask the coordinator for no group")

    def on_group_end(self, w: SimWorker) -> None:
        raise AssertionError("lock-step workers run in run()")
