"""Metrics sinks, the live display and plots."""
