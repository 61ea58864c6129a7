"""adpsgd and a2cid2: pairwise gossip (spec.py: both protocols; coordinator.py: what the
coordinator derives from the graph; state.py: the shared state and its rules; runtime.py:
the runtime behind ripples.Optimizer; sim.py: their workers in the simulator)."""
