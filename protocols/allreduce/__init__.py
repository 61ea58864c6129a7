"""allreduce: PyTorch DDP over every worker, the baseline (runtime.py; sim.py: lock-step
workers in the simulator)."""
