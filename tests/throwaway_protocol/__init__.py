"""ring-pairs: a throwaway protocol that proves the seam (tests/unit/test_protocol_seam.py,
tests/integration/test_throwaway_protocol.py). Each worker averages, after every step,
with the next live worker in id order, in groups its own policy asks the coordinator for.

It is written as a protocol of Ripples would be (docs/architecture.md, "Adding a
protocol"): its own files, and one line to register it, which the tests add at run time
(`register()` below stands for that line of protocols/registry.py).
"""
