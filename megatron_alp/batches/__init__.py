"""Batch sources: where each iteration's scored groups come from (on-policy, ahead by k, dynamic
sampling), how responses are sampled and scored, and benchmark scoring (validation, ``eval``)."""
