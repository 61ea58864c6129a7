"""The protocols: one package each, and the seam that the rest of Ripples sees them by.

    spec.py       what a protocol is to every part (ProtocolSpec: its coordinator Role,
                  its runtime and simulation loaders, its membership, dashboard hints)
    settings.py   the base of every protocol's settings (a dataclass with its own message)
    registry.py   the protocols Ripples runs: one line each
    lockstep.py   what lock-step runtimes share (the agreed stop iteration)
    <name>/       one protocol: settings.py, spec.py, runtime.py (behind ripples.Optimizer),
                  and where it has them, its coordinator role's helpers and sim.py

docs/architecture.md shows how to add one.
"""
