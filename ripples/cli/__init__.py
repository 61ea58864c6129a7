"""The roof: the `ripples` command (one module per command family) and the local cluster
behind `ripples run`. Nothing below imports this package."""
