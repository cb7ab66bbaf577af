"""Fine-tuning pre-trained models: LoRA / QLoRA adapters (lora.py) in peft's format
(peft_format.py)."""
