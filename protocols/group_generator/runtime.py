"""`ripples-random` and `ripples-smart`: P-Reduce in groups made by the Group Generator.

With local steps (`--local-steps H`) a worker asks for groups after every H-th step only:
its rounds are H steps long, and a group whose members are between two of their rounds
waits for them (their request counters, which the smart policy's filter compares, count
rounds). With `--sync-share F` each worker sizes its own rounds to its link instead, H to
8H steps (worker/dataplane/local_rounds.py, `RoundSizer`).
With `--outer-optimizer nesterov` a group averages its members' outer steps
(worker/dataplane/outer_state.py) instead of their models: each member keeps its own
anchor and momentum between groups, and a group leaves every member with the group's.

With `--overlap` a group's P-Reduce runs in the background (worker/dataplane/
background.py): the worker starts it and trains on, looks at every step boundary whether
it is done (never waiting) and applies it then; it waits for it only before it asks for
its next group (the coordinator counts the worker busy until it releases the group, so
asking first could wait on itself), before a heal and at the stop. Of several groups the
coordinator hands out in one round, each but the last is thus waited for at once."""

from __future__ import annotations

import dataclasses
import logging
import time

from ripples.protocols.group_generator.settings import GroupGeneratorSettings
from ripples.rpc import ID_SPACE_BITS, CoordinatorCallError
from ripples.v1 import coordinator_pb2 as pb
from ripples.v1 import replica_pb2 as rpb
from ripples.worker.dataplane.background import BackgroundAverage
from ripples.worker.dataplane.communicators import Communicator
from ripples.worker.dataplane.group_sync import average_in_group, group_bytes, heal_in_group
from ripples.worker.dataplane.local_rounds import RoundSizer, local_steps
from ripples.worker.dataplane.outer_state import OuterState
from ripples.worker.metrics import MetricSpec
from ripples.worker.protocol import (
    COORDINATOR_RETRY_SECONDS,
    Protocol,
    ProtocolContext,
    StreamInterrupted,
    SyncResult,
    fail_group,
    group_communicator,
    heal_from_peer,
    max_peer_wait_seconds,
    run_group_collective,
)
from ripples.worker.replica import ReplicaMismatch
from ripples.worker.shard import ROOT_GROUP_WAIT_SECONDS, ROOT_HEAL_WAIT_SECONDS

logger = logging.getLogger(__name__)

# Server-side bound on the wait for one group reply; the worker then asks again.
ROOT_PROTOCOLS = ("ripples-random", "ripples-smart")
"""What the root's run of a sharded job may use: this package's protocols (spec.py marks
them shardable), whose rounds at the root are the same P-Reduce rounds."""
GROUP_POLL_SECONDS = 10.0


@dataclasses.dataclass(kw_only=True)
class _Started:
    """A group whose P-Reduce runs in the background."""

    group: pb.Group
    key: str
    step: int
    """The step whose state it averages."""
    since: float
    """perf_counter() when it started."""


class GroupGeneratorProtocol(Protocol):
    """After each step: ask the coordinator for groups and P-Reduce in each, in order.

    The coordinator decides the policy (random or smart) from the run config; this side
    only executes what it is told. One group is in flight at a time, taken in the
    coordinator's global order, which rules out wait cycles between overlapping groups.
    """

    name = "ripples-gg"
    averages_optimizer_state = True
    flags_nonfinite = True  # AveragedState's and the outer step's P-Reduces carry them
    metrics = (
        MetricSpec("ripples_worker_overlap_landed_groups", "counter",
                   "--overlap: background P-Reduces applied at a step boundary without "
                   "a wait (the averaging was off the critical path)."),
        MetricSpec("ripples_worker_overlap_waited_groups", "counter",
                   "--overlap: background P-Reduces the worker waited for (before its "
                   "next group, before the optimizer state joins, at a load, or at the "
                   "stop)."),
        MetricSpec("ripples_worker_overlap_lag_steps", "counter",
                   "--overlap: steps between a background P-Reduce's start and its "
                   "landing at a step boundary, summed (over the landed and waited "
                   "groups: the mean lag; one landed at the stop or a load adds none)."),
    )

    def __init__(self, ctx: ProtocolContext) -> None:
        super().__init__(ctx)
        self.timeout = ctx.config.collective_timeout_seconds
        # A group may wait for slow peers' iterations; give up only after this long.
        self.max_group_wait_seconds = max_peer_wait_seconds(ctx.config)
        self.stream = ctx.open_group_stream()
        self._outage_steps = 0  # steps in a row without the coordinator
        self._outage_since = 0  # the step the current outage began at (for its log lines)
        self._incarnation = 0  # the coordinator's life whose groups the cache holds
        self._root: GroupGeneratorProtocol | None = None
        """A shard's head: this protocol in the root's run (its rounds there)."""
        self.poll_seconds = GROUP_POLL_SECONDS
        """Server-side bound on one wait for a group reply."""
        self.retry_ends_round = False
        """A wait that ran out (RETRY) ends the round with no group, rather than asking
        again: a head's rounds at the root, which never hold its shard up for long."""
        self.local_steps = local_steps(ctx.config)
        settings = GroupGeneratorSettings.of_config(ctx.config)
        self._sizer = (RoundSizer(self.local_steps, settings.sync_share)
                       if settings.sync_share else None)
        """sync_share: rounds sized to the link (None: every round is H steps)."""
        self._round_end: int | None = None
        """Sized rounds: the step the current round ends at (None: the first multiple
        of H)."""
        self._last_round: tuple[int, float] | None = None
        """Sized rounds: the step the last round ended at and when (perf_counter)."""
        self._logged_round = self.local_steps
        self.outer = OuterState.of_config(ctx.state, ctx.config)
        overlap = settings.overlap
        self._background = BackgroundAverage(ctx.state, self.outer) if overlap else None
        """--overlap: where the group's P-Reduce runs (None: in the step, synchronously)."""
        self._started: _Started | None = None
        self._landed_early = SyncResult()
        """What landing a background P-Reduce outside after_step cost (the adoption of the
        optimizer state), reported with the next step's result."""
        self._overlap = {"groups": 0, "landed_in_background": 0, "waited": 0,
                         "failed": 0, "lag_steps": 0}
        self._metrics = ctx.metrics.declare(*self.metrics)  # 0 without --overlap
        """--overlap: groups started in the background, how many of them landed at a
        step boundary without a wait, were waited for or failed, and the steps they
        landed after their start, summed."""

    def begin(self) -> None:
        """A replacement heals before its first step: it copies a live peer's model in
        the heal group the coordinator makes for it (docs/fault-tolerance.md)."""
        if self.ctx.membership.replacement:
            heal_from_peer(self.ctx, self.stream, self._execute, self.max_group_wait_seconds)
        link = self.ctx.root
        if link is not None:  # a shard's head joins the root's run (worker/shard.py)
            root_ctx = link.open(self.ctx.model, self.ctx.state, accepts=ROOT_PROTOCOLS)
            if root_ctx is not None:
                root = self._root = GroupGeneratorProtocol(root_ctx)
                root.poll_seconds = ROOT_GROUP_WAIT_SECONDS
                root.retry_ends_round = True
                root.max_group_wait_seconds = ROOT_HEAL_WAIT_SECONDS
                if root.local_steps > 1 or root.outer is not None or root.overlaps:
                    self._leave_root(error="the root's run has local steps, an outer "
                                           "optimizer or overlap, which sharded jobs do "
                                           "not take yet")
                    return
                try:
                    root.begin()  # a replacement head heals at the root too
                except (CoordinatorCallError, TimeoutError) as err:
                    self._leave_root(error=str(err)[:500])

    def should_stop(self, completed: int, planned: int) -> SyncResult | None:
        if self.ctx.stop_requested.is_set():
            return self.ctx.coordinator_stop()
        return None

    def after_step(self, completed: int) -> SyncResult:
        landed, self._landed_early = self._landed_early, SyncResult()
        if self._started is not None:
            self._land(landed, completed, wait=False)
        if not self._round_ends(completed):  # inside a round of local steps
            return landed
        root, link = self._root, self.ctx.root
        if root is None or link is None or completed % link.inter_period:
            started = time.perf_counter()
            result = self._round(completed)
            self._size_next_round(completed, started)
            return landed.merged(result)
        # A shard's head: this round is at the root, with other shards' heads.
        if root.ctx.stop_requested.is_set():  # the root's run stopped, or the root is lost
            fatal = link.session.fatal_error
            if fatal:
                self._leave_root(error=fatal[:500])
            else:
                self._leave_root(reason=root.ctx.stop_reason() or "the root's run stopped")
            return self._round(completed)
        try:
            result = root.after_step(completed)
        except (CoordinatorCallError, TimeoutError) as err:
            self._leave_root(error=str(err)[:500])
            return self._round(completed)
        if result.stop:
            self._leave_root(reason=result.stop_reason)
            result = dataclasses.replace(result, stop=False, stop_reason="")
        if result.num_groups:
            return result
        # No root group this time (none formed, the root is unreachable): the shard's.
        shard = self._round(completed)
        return dataclasses.replace(shard, wait_seconds=shard.wait_seconds + result.wait_seconds)

    def _round_ends(self, completed: int) -> bool:
        """Whether step `completed` ends a round: every multiple of H, or with sized
        rounds the step the current one was sized to end at."""
        if self._sizer is None or self._round_end is None:
            return completed % self.local_steps == 0
        return completed >= self._round_end

    def _size_next_round(self, completed: int, started: float) -> None:
        """Sized rounds: the next round's length from this round's synchronisation
        (since `started`) and its steps' time (since the last round ended). Logged when
        it moved by half or more since last logged."""
        if self._sizer is None:
            return
        replica = self.ctx.replica
        if replica is not None and not replica.leads:  # a worker's rounds are its rank 0's
            sized = replica.receive("round", rpb.ReplicaRound())
            assert isinstance(sized, rpb.ReplicaRound)
            if sized.completed != completed:
                raise ReplicaMismatch(f"rank {replica.rank} ended a round at step {completed} "
                                      f"while rank 0 ended one at step {sized.completed}")
            self._sizer.steps = int(sized.steps)
            self._round_end = completed + self._sizer.steps
            return
        now, last = time.perf_counter(), self._last_round
        if last is not None and completed > last[0]:
            step = (started - last[1]) / (completed - last[0])
            steps = self._sizer.next_round(now - started, step)
            if not 2 / 3 < steps / self._logged_round < 3 / 2:
                logger.info("rounds of %d steps from step %d (were %d): a synchronisation "
                            "took %.2f s, a step %.3f s", steps, completed,
                            self._logged_round, now - started, step)
                self._logged_round = steps
        self._last_round = (completed, now)
        self._round_end = completed + self._sizer.steps
        if replica is not None:
            replica.send("round", rpb.ReplicaRound(completed=completed, steps=self._sizer.steps))

    def _leave_root(self, *, error: str = "", reason: str = "") -> None:
        """End the head's part in the root's run; it averages in its shard alone."""
        assert self._root is not None and self.ctx.root is not None
        log = logger.warning if error else logger.info
        log("leaving the root's run; this head averages in its shard alone from now: %s",
            error or reason)
        self._root.close()
        self._root = None
        self.ctx.root.close(error=error, reason=reason)

    def _round(self, completed: int) -> SyncResult:
        """One round of groups at this protocol's coordinator."""
        result = SyncResult()
        sizes: list[int] = []
        durations: list[float] = []
        waited_since = time.perf_counter()
        while True:
            if self._started is not None:  # the coordinator holds this worker's next
                self._land(result, completed, wait=True)  # group until it releases it
            t0 = time.perf_counter()
            reply = self._ask(completed)
            result.wait_seconds += time.perf_counter() - t0
            if reply is None:  # the coordinator is unreachable: train on alone
                break
            for comm_id in reply.evict_comm_ids:
                self.ctx.comms.drop(f"gg/{self.ctx.config.run_id}/{comm_id}")
            if reply.outcome == pb.GROUP_OUTCOME_RETRY:
                if self.retry_ends_round:
                    break
                waited = time.perf_counter() - waited_since
                if waited > self.max_group_wait_seconds:
                    raise TimeoutError(f"no group after {waited:.0f} s: {reply.detail}")
                logger.info("still waiting for a group after %.0f s: %s", waited, reply.detail)
                continue
            if reply.outcome == pb.GROUP_OUTCOME_STOP:
                result.stop, result.stop_reason = True, reply.detail
                break
            if reply.outcome != pb.GROUP_OUTCOME_GROUP:  # NO_GROUP, CANCELLED: go on training
                if reply.outcome == pb.GROUP_OUTCOME_CANCELLED:
                    logger.info("group cancelled: %s", reply.detail)
                break
            seconds, ok = self._execute(reply.group, completed)
            result.preduce_seconds += seconds
            result.num_groups += 1
            result.num_failed_groups += not ok
            result.preduce_bytes += self._bytes_sent(reply.group)
            sizes.append(len(reply.group.members))
            durations.append(seconds)
            if not reply.more:
                break
            waited_since = time.perf_counter()
        result.group_sizes = tuple(sizes)
        result.preduce_durations = tuple(durations)
        return result

    def _forget_old_incarnation(self) -> None:
        """After a coordinator restart, drop every communicator its predecessor's groups
        built, here, between two collectives. The new incarnation hands out comm ids of
        its own (they would never be used again), and closing them frees any peer held
        in a group the old incarnation delivered to it but never to this worker (killed
        mid-delivery): that peer's collective fails at once instead of after the
        collective timeout (a chaos trial saw the survivors stand 57 s)."""
        incarnation = self.ctx.incarnation()
        if incarnation == self._incarnation:
            return
        if self._incarnation:
            prefix, first_new = f"gg/{self.ctx.config.run_id}/", incarnation << ID_SPACE_BITS

            def older(key: str) -> bool:  # not one the new incarnation built already
                return key.startswith(prefix) and int(key[len(prefix):]) < first_new

            dropped = self.ctx.comms.drop_where(older)
            logger.info("the coordinator restarted (incarnation %d): dropped the %d "
                        "communicators of its predecessor's groups", incarnation, dropped)
        self._incarnation = incarnation

    def _ask(self, completed: int) -> pb.GroupReply | None:
        """The coordinator's reply to this step's request; None while it is unreachable:
        train on alone, for up to the run's outage_local_steps steps in a row, then wait
        for it here (the heartbeat ends the wait once the outage window is over). A worker
        asks once per round, so each unanswered ask lets the next round's H steps go on
        alone: they count H (local_steps) towards the bound, not 1."""
        waiting = False
        while True:
            self._forget_old_incarnation()
            try:
                reply = self.stream.request(completed, self.poll_seconds, self.ctx.progress())
            except StreamInterrupted as err:
                if not self._outage_steps and not waiting:
                    self._outage_since = completed
                    logger.warning("training on without averaging while the coordinator is "
                                   "unreachable (from step %d): %s", completed, err)
                round_steps = self.local_steps if self._sizer is None else self._sizer.steps
                if self._outage_steps + round_steps <= self.ctx.config.outage_local_steps:
                    self._outage_steps += round_steps
                    return None
                if self.ctx.stop_requested.is_set():
                    return None
                if not waiting:
                    logger.warning("%d steps without the coordinator (steps %d to %d): "
                                   "waiting for it", self._outage_steps, self._outage_since,
                                   completed)
                    waiting = True
                time.sleep(COORDINATOR_RETRY_SECONDS)
                continue
            self._outage_steps = 0
            return reply

    def _execute(self, group: pb.Group, completed: int | None = None) -> tuple[float, bool]:
        """Run one P-Reduce (or, in a heal group, the joiner's copy of the donor's
        model); with --overlap, a P-Reduce of a round (after step `completed`) starts in
        the background instead. Returns its seconds here and whether it succeeded (or
        started)."""
        key = f"gg/{self.ctx.config.run_id}/{group.comm_id}"
        if group.heal:
            donor = list(group.members).index(group.heal_donor)
            return run_group_collective(self.ctx, self.stream, group, key, lambda comm: (
                heal_in_group(self.ctx.state, self.outer, comm, donor, self.timeout)))
        if self._background is not None and completed is not None:
            return self._start(group, key, completed)
        return run_group_collective(self.ctx, self.stream, group, key, self.average)

    # ------------------------------------------------------------------ --overlap
    def _start(self, group: pb.Group, key: str, completed: int) -> tuple[float, bool]:
        """Start the group's P-Reduce in the background; the group is released when it
        lands (`_land`)."""
        assert self._background is not None and self._started is None
        t0 = time.perf_counter()
        try:
            self._background.start(group_communicator(self.ctx, group, key), self.timeout)
        except (RuntimeError, TimeoutError, ValueError) as err:
            seconds = time.perf_counter() - t0
            fail_group(self.ctx, self.stream, group, key, err, seconds, abort=True)
            return seconds, False
        self._started = _Started(group=group, key=key, step=completed, since=t0)
        self._overlap["groups"] += 1
        return time.perf_counter() - t0, True

    def _land(self, result: SyncResult, completed: int | None, *, wait: bool) -> None:
        """Apply the background P-Reduce if it is done (`wait`: wait for it, up to its
        deadline) and release its group; a failure counts in `result` as a failed group
        and leaves the state as it was."""
        started, background = self._started, self._background
        assert started is not None and background is not None
        t0 = time.perf_counter()
        try:
            if wait:
                background.wait()
            landed = wait or background.poll()
        except (RuntimeError, TimeoutError) as err:
            self._started = None
            self._overlap["failed"] += 1
            result.preduce_seconds += time.perf_counter() - t0
            result.num_failed_groups += 1
            fail_group(self.ctx, self.stream, started.group, started.key, err,
                       time.perf_counter() - started.since, abort=True)
            return
        result.preduce_seconds += time.perf_counter() - t0
        if not landed:
            return
        self._started = None
        self._overlap["waited" if wait else "landed_in_background"] += 1
        self._metrics[f"ripples_worker_overlap_{'waited' if wait else 'landed'}_groups"].inc()
        if completed is not None:
            self._overlap["lag_steps"] += completed - started.step
            self._metrics["ripples_worker_overlap_lag_steps"].inc(completed - started.step)
        self.stream.release(started.group.group_id, ok=True,
                            preduce_seconds=time.perf_counter() - started.since)

    @property
    def overlaps(self) -> bool:
        """--overlap: P-Reduces start in the background."""
        return self._background is not None

    def may_adopt_state(self, completed: int, ready: bool) -> bool:
        """The optimizer state joins the averaged state at once (the default), after the
        background P-Reduce in flight, if any, has landed: it averages the state as it
        was laid out when it started."""
        if ready and self._started is not None:
            self._land(self._landed_early, completed, wait=True)
        return ready

    def on_stop(self) -> None:
        self.settle()

    def settle(self) -> None:
        """The background P-Reduce in flight, if any, lands (its peers are in it)."""
        if self._started is not None:
            self._land(self._landed_early, None, wait=True)

    def average(self, comm: Communicator) -> None:
        """Average the model over the group, or with an outer optimizer the members' outer
        steps (LPP-SGD's averaging process overrides it)."""
        average_in_group(self.ctx.state, self.outer, comm, self.timeout)

    def _bytes_sent(self, group: pb.Group) -> int:
        """The bytes this worker fed into the group's collective."""
        outer, state = self.outer, self.ctx.state
        if group.heal:
            numel = state.model_numel + (outer.numel if outer is not None else 0)
            return numel * state.flat.element_size()
        return group_bytes(state, outer)

    def record(self) -> dict[str, object]:
        """With --overlap: how its background P-Reduces went (`_overlap`); with the int8
        wire, the blocks it voided for a wrong decode and its width factor at the end;
        with sized rounds, the length its rounds had at the end."""
        record: dict[str, object] = {"overlap": dict(self._overlap)} if self.overlaps else {}
        wire = self.outer.modular if self.outer is not None else None
        if wire is not None:  # read once, at the end
            record["int8"] = {"voided_blocks": int(wire.voided_blocks),
                              "width": float(wire.width)}
        if self._sizer is not None:
            record["round_steps"] = self._sizer.steps
        return record

    def close(self) -> None:
        if self._started is not None:  # failing, or stopped without on_stop: no wait
            assert self._background is not None
            self._background.abandon()
            fail_group(self.ctx, self.stream, self._started.group, self._started.key,
                       RuntimeError("the worker closed with the group's P-Reduce in flight"),
                       time.perf_counter() - self._started.since, abort=True)
            self._started = None
        if self._root is not None:
            self._root.close()
            self._root = None
        self.stream.close()
