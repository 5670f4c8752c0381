"""ms-llm: MindSpore-native LLM training with Megatron-Core-shaped models and a PyTorch-aligned API."""
__version__ = "0.1.0"
