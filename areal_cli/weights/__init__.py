"""Versioned handoff of weights, rollouts and checkpoints through the run directory."""
