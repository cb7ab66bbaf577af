"""Fine-tuning a pre-trained model: task heads' tasks, LoRA / QLoRA adapters in peft's format,
instruction tuning (SFT) and preference tuning (DPO), on built-in or the user's data."""
