"""Trainer-side math: RL advantages and policy losses, and sequence packing into micro-batches."""
