"""Evaluation: accuracy and unbiased pass@k over sampled completions."""
