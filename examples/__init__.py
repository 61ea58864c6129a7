"""Runnable examples of the public API (`python examples/<name>.py`, or `python -m
ripples.examples.<name>` from an installed Ripples): ddp_digits (a plain DDP script),
ripples_digits (the same script under Ripples), transformer_lm (a small GPT trained from
scratch; also a workload of `ripples bench --task transformer-lm`)."""
