"""Datasets: reading rows and turning them into token ids (shared by rollout, SFT and eval)."""
