"""lap-sgd and lpp-sgd: Hogwild updater processes per worker, background averaging
(rules.py: the paper's rules; updater.py: an updater process; runtime.py: the averaging
process, driven by the built-in runner; checkpoints.py: what a restart restores)."""
