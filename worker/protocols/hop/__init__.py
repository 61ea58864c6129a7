"""hop: queue-based decentralized training (engine.py: one worker's queues and tokens as
pure state; protocol.py: the links and the runtime behind ripples.Optimizer)."""
