"""Diagnostics: the training-inference mismatch report and the figures of a run."""
