"""adpsgd and a2cid2: pairwise gossip (state.py: the shared state and its rules;
protocol.py: the runtime behind ripples.Optimizer)."""
