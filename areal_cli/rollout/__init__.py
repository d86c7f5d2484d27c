"""Rollout side: prompt datasets, prompt formatting, and reward functions run in worker processes."""
