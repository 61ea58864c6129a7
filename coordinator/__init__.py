"""Ripples coordinator."""
