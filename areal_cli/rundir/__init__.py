"""The run directory's protocols, shared by every process of a run (see DESIGN §3)."""
