"""Ripples: asynchronous decentralized data-parallel training."""
