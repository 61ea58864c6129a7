"""Hop's queue protocol (worker/protocols/hop/engine.py): the arithmetic of each mode, and
a discrete-event simulation of whole runs with random slowdowns and message delays that checks the
iteration-gap bounds of Table 1 (Theorems 1 and 2) and the queue capacities at every
event, and that every run finishes (no deadlock)."""

from __future__ import annotations

import heapq
import random
from dataclasses import dataclass, field

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ripples.coordinator.topology import build_topology
from ripples.protocols.hop.engine import CreditMsg, HopProtocolError, HopWorker, UpdateMsg
from ripples.protocols.hop.gaps import check_iteration_gaps, graph_distances
from ripples.protocols.hop.settings import HopSettings


def _pair(mode: str = "standard", **kw: int) -> tuple[HopWorker[float], HopWorker[float]]:
    cfg = HopSettings(mode=mode, **kw)
    return HopWorker(0, (1,), (1,), cfg), HopWorker(1, (0,), (0,), cfg)


def test_settings_name_what_is_wrong() -> None:
    for kw, message in [({"mode": "gossip"}, "unknown hop mode"), ({"max_ig": 0}, "max_ig"),
                        ({"mode": "backup", "backup_workers": 0}, "backup_workers"),
                        ({"max_jump": 2}, "needs backup workers or bounded staleness"),
                        ({"mode": "backup", "max_jump": 5, "max_ig": 4}, "may not exceed")]:
        with pytest.raises(ValueError, match=message):
            HopSettings(**kw).validate()  # type: ignore[arg-type]


def test_standard_recv_waits_for_every_in_neighbour_of_the_iteration() -> None:
    cfg = HopSettings(mode="standard", max_ig=2)
    w: HopWorker[float] = HopWorker(0, (1, 2), (1, 2), cfg)
    sent = w.enter(10.0)
    assert sent == [UpdateMsg(1, 0, 0, 10.0), UpdateMsg(2, 0, 0, 10.0)]  # no credits at 0
    w.on_update(UpdateMsg(0, 1, 1, 99.0))  # next iteration's: kept for later
    w.on_update(UpdateMsg(0, 1, 0, 20.0))
    assert not w.recv_ready()
    w.on_update(UpdateMsg(0, 2, 0, 30.0))
    got = w.recv(10.0)
    assert got.payloads == [10.0, 20.0, 30.0] and got.weights == [1.0, 1.0, 1.0]  # Eq. 1
    assert got.reduce() == pytest.approx(20.0)
    assert w.can_advance() and w.advance() == []
    assert w.enter(11.0)[:2] == [CreditMsg(1, 0, 1, 1), CreditMsg(2, 0, 1, 1)]
    w.on_update(UpdateMsg(0, 2, 1, 31.0))
    assert w.recv_ready() and w.recv(11.0).payloads == [11.0, 99.0, 31.0]


def test_tokens_hold_a_worker_max_ig_iterations_ahead_of_its_out_neighbour() -> None:
    a, b = _pair(max_ig=2)
    for k in range(2):
        a.enter(float(k))
        a.on_update(UpdateMsg(0, 1, k, 0.0))  # b sent early updates but stays at 0
        a.recv(float(k))
        assert a.can_advance()
        a.advance()
    assert not a.can_advance() and a.lag() == -2  # a is 2 ahead of b
    with pytest.raises(HopProtocolError, match="cannot advance"):
        a.advance()
    a.on_credit(CreditMsg(0, 1, 1, 1))  # b enters iteration 1: one token
    assert a.can_advance() and a.known_iteration[1] == 1
    with pytest.raises(HopProtocolError, match="more than max_ig"):
        b.on_update(UpdateMsg(1, 0, 3, 0.0))  # b at 0 cannot get iteration 3 with max_ig 2


def test_backup_workers_take_enough_updates_and_drop_late_ones() -> None:
    cfg = HopSettings(mode="backup", backup_workers=1, max_ig=3)
    w: HopWorker[float] = HopWorker(0, (1, 2, 3), (1, 2, 3), cfg)
    w.enter(0.0)
    w.on_update(UpdateMsg(0, 3, 0, 3.0))
    assert not w.recv_ready()  # needs 3 - 1 = 2
    w.on_update(UpdateMsg(0, 1, 0, 1.0))
    assert w.recv_ready() and w.recv(0.0).senders == [0, 3, 1]
    w.advance()
    w.on_update(UpdateMsg(0, 2, 0, 2.0))  # too late for iteration 0: dropped
    assert w.num_stale_dropped == 1 and w.queue_depth() == 0
    # §6.2: a receiver known to be past this iteration gets no update.
    w.on_credit(CreditMsg(0, 2, 2, 2))
    sent = w.enter(5.0)
    assert [m.to for m in sent if isinstance(m, UpdateMsg)] == [1, 3] and w.num_not_sent == 1


def test_staleness_weights_updates_by_their_iteration_as_eq_2() -> None:
    cfg = HopSettings(mode="staleness", staleness=2, max_ig=4)
    w: HopWorker[float] = HopWorker(0, (1, 2), (1, 2), cfg)
    w.iteration = 3
    w.on_update(UpdateMsg(0, 1, 1, 1.0))
    w.on_update(UpdateMsg(0, 1, 2, 2.0))  # replaces the older one: iteration 2, weight 2
    w.on_update(UpdateMsg(0, 2, 0, 0.0))
    assert not w.recv_ready()  # worker 2's newest (0) is older than k - s = 1
    w.on_update(UpdateMsg(0, 2, 4, 4.0))  # newer than the iteration: weight s + 2
    got = w.recv(3.0)
    assert got.weights == [3.0, 2.0, 4.0] and got.iterations == [3, 2, 4]
    assert got.reduce() == pytest.approx((3 * 3.0 + 2 * 2.0 + 4 * 4.0) / 9)
    assert w.num_stale_dropped == 2
    w.iteration = 4
    # Nothing new from either, but both last updates (2, 4) are recent enough: no wait.
    assert w.recv_ready() and w.recv(4.0).payloads == [4.0]
    w.iteration = 5
    assert not w.recv_ready()  # 5 - 2 = 3 > worker 1's 2


def test_a_straggler_jumps_renews_at_the_iteration_before_and_pays_tokens_both_ways() -> None:
    cfg = HopSettings(mode="backup", backup_workers=1, max_ig=4, max_jump=3, skip_threshold=1)
    w: HopWorker[float] = HopWorker(0, (1, 2), (1, 2), cfg)
    w.enter(0.0)
    for j in (1, 2):
        w.on_credit(CreditMsg(0, j, 3, 3))  # both neighbours entered iteration 3
        for t in range(4):
            w.on_update(UpdateMsg(0, j, t, float(t)))
    w.recv(0.0)
    assert w.lag() == 3 and w.jump_length() == 3
    credits = w.advance(3)
    assert w.iteration == 3 and w.jump_recv == 2 and w.iterations_skipped == 2
    assert credits == [CreditMsg(1, 0, 2, 2), CreditMsg(2, 0, 2, 2)]  # tokens of 1 and 2
    with pytest.raises(HopProtocolError, match="must Recv"):
        w.enter(0.0)
    assert w.recv_ready() and w.recv(0.0).iterations == [2, 2, 2]
    assert [m for m in w.enter(2.0) if isinstance(m, CreditMsg)] == [
        CreditMsg(1, 0, 3, 1), CreditMsg(2, 0, 3, 1)]
    assert w.recv_ready() and w.recv(2.0).iterations == [3, 3, 3]


# ---------------------------------------------------------------------- simulation


@dataclass(order=True)
class _Event:
    time: float
    seq: int
    kind: str = field(compare=False)
    worker: int = field(compare=False)
    msg: object = field(compare=False, default=None)


class HopSimulation:
    """Workers run compute -> Recv/Reduce -> take tokens (maybe jump) -> next iteration,
    with random compute times and message delays (not FIFO: a stronger test than the
    per-edge streams of the runtime). Invariants are checked after every event."""

    def __init__(self, topology: str, n: int, cfg: HopSettings, max_iter: int, seed: int,
                 straggler: float, p_slow: float) -> None:
        topo = build_topology(topology, n)
        self.nbrs = {i: tuple(topo.neighbours[i]) for i in range(n)}
        self.dist = graph_distances(self.nbrs)
        self.cfg, self.max_iter, self.rng = cfg, max_iter, random.Random(seed)
        self.straggler, self.p_slow = straggler, p_slow
        self.workers = {i: HopWorker[float](i, self.nbrs[i], self.nbrs[i], cfg) for i in range(n)}
        self.state = dict.fromkeys(range(n), "compute")
        self.param = {i: 0.0 for i in range(n)}
        self.events: list[_Event] = []
        self.seq = 0
        self.max_gap_seen = 0
        # Per worker, (order, iteration) at every advance: what the runtime records.
        self.timelines: dict[int, list[tuple[float, int]]] = {i: [] for i in range(n)}

    def _push(self, delay: float, kind: str, worker: int, msg: object = None) -> None:
        self.seq += 1
        heapq.heappush(self.events, _Event(self.time + delay, self.seq, kind, worker, msg))

    def _send(self, msgs: list) -> None:
        for m in msgs:
            self._push(self.rng.uniform(0.0, 0.5), "deliver", m.to, m)

    def _enter(self, i: int) -> None:
        self._send(self.workers[i].enter(self.param[i]))
        self.state[i] = "compute"
        duration = 1.0 * (self.straggler if i == 0 else 1.0)
        if self.rng.random() < self.p_slow:
            duration *= 6.0
        self._push(duration * self.rng.uniform(0.8, 1.2), "computed", i)

    def _progress(self, i: int) -> None:
        """Move worker i through every step that no longer blocks."""
        w = self.workers[i]
        while True:
            if self.state[i] == "recv" and w.recv_ready():
                self.param[i] = w.recv(self.param[i]).reduce() + 1.0  # + a "gradient step"
                if w.iteration >= self.max_iter:
                    self.state[i] = "done"
                    return
                self.state[i] = "tokens"
            elif self.state[i] == "tokens" and w.can_advance():
                jump = min(w.jump_length(), self.max_iter - w.iteration)
                self._send(w.advance(jump))
                self.seq += 1
                self.timelines[i].append((float(self.seq), w.iteration))
                self.state[i] = "jump-recv" if w.jump_recv is not None else "enter"
            elif self.state[i] == "jump-recv" and w.recv_ready():
                self.param[i] = w.recv(self.param[i]).reduce()  # renew; no gradient
                self.state[i] = "enter"
            elif self.state[i] == "enter":
                self._enter(i)
                return
            else:
                return

    def _check(self) -> None:
        cfg, ws = self.cfg, self.workers
        for i in ws:
            for j in ws:
                if i == j:
                    continue
                gap = ws[i].iteration - ws[j].iteration
                self.max_gap_seen = max(self.max_gap_seen, gap)
                bound = cfg.gap_bound(self.dist[(i, j)], self.dist[(j, i)])
                assert gap <= bound, (f"Iter({i}) - Iter({j}) = {gap} > {bound}",
                                      {k: (w.iteration, self.state[k]) for k, w in ws.items()})
            w = ws[i]
            assert w.queue_depth() <= (1 + cfg.max_ig) * len(w.in_neighbours), w.queue_depth()
            for j, credits in w.credits.items():  # = TokenQ(j -> i).size()
                assert 0 <= credits <= cfg.max_ig * (self.dist[(j, i)] + 1), (i, j, credits)

    def run(self) -> None:
        self.time = 0.0
        for i in self.workers:
            self._enter(i)
        while self.events:
            ev = heapq.heappop(self.events)
            self.time = ev.time
            w = self.workers[ev.worker]
            if ev.kind == "computed":
                self.state[ev.worker] = "recv"
            elif isinstance(ev.msg, UpdateMsg):
                w.on_update(ev.msg)
            else:
                assert isinstance(ev.msg, CreditMsg)
                w.on_credit(ev.msg)
            self._progress(ev.worker)
            self._check()
        stuck = {i: (w.iteration, self.state[i]) for i, w in self.workers.items()
                 if self.state[i] != "done"}
        assert not stuck, f"deadlock: no event left, workers still running: {stuck}"


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(topology=st.sampled_from(["ring", "complete", "ring-based", "exponential"]),
       n=st.integers(3, 8), mode=st.sampled_from(["standard", "backup", "staleness"]),
       max_ig=st.integers(1, 4), backup=st.integers(1, 2), staleness=st.integers(0, 3),
       jump=st.integers(0, 4), threshold=st.integers(0, 2), seed=st.integers(0, 10**6),
       straggler=st.sampled_from([1.0, 4.0]), p_slow=st.sampled_from([0.0, 0.125, 0.3]))
def test_simulated_runs_stay_within_table_1_and_always_finish(
        topology: str, n: int, mode: str, max_ig: int, backup: int, staleness: int,
        jump: int, threshold: int, seed: int, straggler: float, p_slow: float) -> None:
    jump = 0 if mode == "standard" else min(jump, max_ig)
    cfg = HopSettings(mode=mode, max_ig=max_ig, backup_workers=backup, staleness=staleness,
                      max_jump=jump, skip_threshold=threshold)
    sim = HopSimulation(topology, n, cfg, max_iter=30, seed=seed, straggler=straggler,
                        p_slow=p_slow)
    sim.run()
    assert all(w.iteration == 30 for w in sim.workers.values())
    # The offline check that `ripples run` applies to recorded timelines agrees.
    report = check_iteration_gaps(sim.timelines, sim.nbrs, cfg)
    assert report.num_violations == 0, report.violations
    assert report.max_gap == sim.max_gap_seen and report.tightest <= 1.0


def test_skipping_lets_a_deterministic_straggler_keep_up() -> None:
    """§5: with one worker 4x slower, skipping moves it along with the others, and the
    others finish sooner than without skipping."""
    def finish_time(max_jump: int) -> tuple[float, int]:
        cfg = HopSettings(mode="backup", backup_workers=1, max_ig=4, max_jump=max_jump,
                          skip_threshold=1)
        sim = HopSimulation("ring-based", 8, cfg, max_iter=60, seed=3, straggler=4.0,
                            p_slow=0.0)
        sim.run()
        return sim.time, sim.workers[0].iterations_skipped

    plain, skipped_plain = finish_time(0)
    with_skips, skipped = finish_time(4)
    assert skipped_plain == 0 and skipped > 0
    assert with_skips < plain


def test_the_gap_bound_is_table_1() -> None:
    """Table 1 for i two hops upstream of j and three hops downstream of it."""
    assert HopSettings(mode="standard", max_ig=4).gap_bound(2, 3) == min(1 * 3, 4 * 2)
    assert HopSettings(mode="staleness", staleness=2, max_ig=4).gap_bound(2, 3) == 8
    assert HopSettings(mode="staleness", staleness=0, max_ig=4).gap_bound(2, 1) == 1
    assert HopSettings(mode="backup", max_ig=3).gap_bound(2, 1) == 6  # tokens only


def test_the_gap_check_reports_a_worker_that_ran_past_its_bound() -> None:
    """Worker 0 of a 3-ring enters iteration 3 while worker 1 is still at 0: over a
    standard setting's bound of 1 (b0 x 1 hop). Replayed in time order, not file order."""
    ring = {0: [1, 2], 1: [0, 2], 2: [0, 1]}
    cfg = HopSettings(mode="standard", max_ig=4)
    fine = {0: [(1.0, 1), (3.0, 2)], 1: [(2.0, 1)], 2: [(1.5, 1), (2.5, 2)]}
    report = check_iteration_gaps(fine, ring, cfg)
    assert (report.events, report.max_gap, report.num_violations) == (5, 1, 0)
    assert report.tightest == 1.0 and report.max_bound == 1
    bad = {0: [(3.0, 3), (1.0, 1)], 1: [(4.0, 1)], 2: [(0.5, 1)]}
    report = check_iteration_gaps(bad, ring, cfg)
    assert report.num_violations >= 1 and report.max_gap == 3
    assert report.violations[0].startswith("t=3.000: Iter(0) - Iter(1) = 3 - 0 = 3 > bound 1")
