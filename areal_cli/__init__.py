"""areal: asynchronous RL for language models."""
