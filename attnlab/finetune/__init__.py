"""Fine-tuning: task objectives, metrics and tasks for the training loop (issue 21)."""
