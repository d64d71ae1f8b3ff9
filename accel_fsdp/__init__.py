"""accel-fsdp: fine-tune GPT-2 and Llama models with PyTorch FSDP through Hugging Face Accelerate."""

__version__ = "0.1.0"
