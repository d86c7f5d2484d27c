"""Builtin models (`model.path: builtin:NAME`), built locally from code; no download."""
