"""First-in-first-out pairing of available gossip workers (A2CiD2's coordinator).

Pure code. A worker is *available* when it has finished its previous averaging and owes
another one. The coordinator pairs an arriving worker with the neighbour that has waited
longest among the available ones; with none, the worker joins the queue. Only worker ids
pass through here, never tensors.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection


class FifoPairing:
    """The queue of available workers, oldest first.

    Invariants: a worker is queued at most once; a pair always joins two neighbours (the
    caller passes the arriving worker's neighbour set); a queued worker has no available
    neighbour in the queue (otherwise it would have been paired when the later of the two
    arrived), so a pair forms exactly when two available neighbours meet.
    """

    def __init__(self) -> None:
        self._queue: OrderedDict[int, None] = OrderedDict()

    def offer(self, worker: int, neighbours: Collection[int] | None) -> int | None:
        """`worker` becomes available. Returns the partner it is paired with now (removed
        from the queue), or None after queueing it. `neighbours` None: any worker."""
        if worker in self._queue:
            raise ValueError(f"worker {worker} is already waiting for a partner")
        for waiting in self._queue:
            if neighbours is None or waiting in neighbours:
                del self._queue[waiting]
                return waiting
        self._queue[worker] = None
        return None

    def withdraw(self, worker: int) -> bool:
        """Take `worker` out of the queue (its wait ran out, or it left); True if it was in."""
        if worker not in self._queue:
            return False
        del self._queue[worker]
        return True

    def waiting(self) -> tuple[int, ...]:
        return tuple(self._queue)

    def clear(self) -> None:
        self._queue.clear()

    def __contains__(self, worker: object) -> bool:
        return worker in self._queue
