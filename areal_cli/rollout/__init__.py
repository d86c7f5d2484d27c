"""Rollout side: the controller's loop in parts (gate, groups, batch, sync, metrics, wired
by controller.py; see rollout.state), server recovery, episode workflows and rewards."""
