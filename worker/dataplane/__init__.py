"""The data plane: model tensors between workers, never through the coordinator.

`averaged_state` (what is averaged, in one flat buffer), `communicators` (gloo / NCCL
process groups built for a group's members on the coordinator's rendezvous store) and
`preduce` (Partial All-Reduce on them). docs/data-plane.md gives the measured rules they
follow.
"""
