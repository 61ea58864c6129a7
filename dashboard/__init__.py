"""Ripples dashboard."""
