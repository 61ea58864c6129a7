"""allreduce's workers in the simulator: lock-step, no coordinator per iteration."""

from __future__ import annotations

from ripples.coordinator.decisions import GroupDecision
from ripples.sim.models import shared_finish_times
from ripples.sim.worker_model import SimulatedWorkers, SimWorker


class LockstepWorkers(SimulatedWorkers):
    """Iteration k ends when the slowest worker computed it and the ring all-reduce over
    every worker is done; every model is then the average (DDP's arithmetic).

    With local steps or the outer optimizer (DiLoCo's form, runtime.py): every worker
    takes H steps at its own pace, then one all-reduce over all of them when the slowest
    is done: of the models (outer optimizer none) or of the pseudo-gradients, on which
    every worker takes the same outer step (the first synchronisation carries the
    anchors and momenta too, until they are known to agree: twice the bytes). A budget
    that ends inside a round ends with the plain mean of the models. On shared cores a
    round's iterations are shared as if in lock-step (an approximation: the workers run
    H steps apart between synchronisations)."""

    def run(self) -> str:
        sim = self.sim
        cfg = sim.config
        every = sim.settings.local_steps
        n = cfg.workers
        ranks = list(range(n))
        spans = n > cfg.workers_per_host
        sample_every = sim.sample_interval()
        next_sample = 0.0
        cores = cfg.compute.cores
        in_agreement = False  # the anchors and momenta are known to be equal
        since_sync = [0.0] * n  # each worker's compute since the last synchronisation
        round_start = sim.now
        for iteration in range(1, cfg.iterations + 1):
            draws = [sim.compute_times.draw(w.rank) for w in sim.workers]
            took = (shared_finish_times([work for work, _ in draws], cores) if cores
                    else [work for work, _ in draws])
            times = [t * factor for t, (_, factor) in zip(took, draws, strict=True)]
            for w, t in zip(sim.workers, times, strict=True):
                w.compute_s += t
                w.iteration += 1
                since_sync[w.rank] += t
            slowest = max(since_sync)
            sim.now = round_start + slowest
            sim.events += 1
            for r in ranks:
                sim.model.step(r)
            final = iteration == cfg.iterations
            if iteration % every == 0 or final:
                outer_step = sim.outer is not None and iteration % every == 0
                vectors = (1.0 if sim.outer is None or not outer_step else
                           sim.outer.delta_vectors if in_agreement else
                           sim.outer.group_vectors)
                ring = sim.comm.allreduce_seconds(n, spans_hosts=spans, vectors=vectors)
                # Shared cores: the ring's n threads share them too.
                collective = ring * max(1.0, n / cores) if cores else ring
                for w in sim.workers:
                    w.wait_s += slowest - since_sync[w.rank]
                    w.comm_s += collective
                    since_sync[w.rank] = 0.0
                sim.now += collective
                round_start = sim.now
                sim.record_collective(n, vectors)
                if outer_step:
                    sim.model.average(ranks, sim.model.snapshot(ranks))
                    in_agreement = True
                else:  # DDP, local SGD, or a stop inside a round: the mean of the models
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
