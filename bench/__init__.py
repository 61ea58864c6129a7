"""Ripples bench."""
