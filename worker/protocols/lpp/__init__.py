"""lap-sgd and lpp-sgd: Hogwild updater processes per worker, background averaging
(rules.py: the paper's rules; updater.py: an updater process; protocol.py: the averaging
process, driven by the built-in runner)."""
