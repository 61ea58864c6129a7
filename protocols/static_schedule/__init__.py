"""ripples-static: P-Reduce on the static conflict-free schedule, computed by the workers
themselves (runtime.py)."""
