"""Hugging Face model folders: ``io`` reads and writes ``config.json`` + safetensors without
torch; ``pretrained`` builds a GPTModel from such a folder (or a Megatron one)."""
