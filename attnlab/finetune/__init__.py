"""Fine-tuning a pre-trained model: task heads, LoRA, instruction and preference tuning."""
