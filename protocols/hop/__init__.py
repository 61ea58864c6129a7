"""hop: queue-based decentralized training (engine.py: one worker's queues and tokens as
pure state; runtime.py: the links and the runtime behind ripples.Optimizer; gaps.py: the
bound on iteration gaps and the check of a run against it)."""
