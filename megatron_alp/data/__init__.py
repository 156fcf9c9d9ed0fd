"""What the trainer reads and learns from: prompt data sets, the tokenizer, trajectories."""
