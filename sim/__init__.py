"""`ripples simulate`: the coordinator's real pure core driven by simulated workers.

A discrete-event simulation with a fake clock, no processes and no sockets: thousands
to a hundred thousand simulated workers ask the real `CoordinatorCore` for groups,
heartbeat and release as the real workers do, while models of compute time, links and
averaging (sim/models.py) stand in for the GPUs. It answers how far one coordinator
goes, and how the protocols compare at scales no test cluster has (docs/scale.md).

`ripples.sim.config` holds what a run is (SimConfig) and what it measured (SimResult),
without torch; `ripples.sim.engine` runs it.
"""
