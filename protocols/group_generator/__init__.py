"""ripples-random and ripples-smart: P-Reduce in the groups the coordinator's Group
Generator forms (settings.py; spec.py: both protocols; runtime.py: ask, wait, P-Reduce,
release; sim.py: their workers in the simulator)."""
