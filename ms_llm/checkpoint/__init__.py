"""Checkpoint formats and conversion, one folder per format: ms-llm's own distributed checkpoint
(``native``), Hugging Face folders (``hf``), Megatron legacy torch folders (``megatron``, over
``torch_pickle``), Megatron-Core ``torch_dist`` folders (``torch_dist``); the HF <-> Megatron
converter (``convert``, ``ms-llm convert``), LoRA adapter files (``adapters``) and checkpoint
verification (``verify``); the tensor layouts they write live with the models
(``ms_llm.models.layouts``).

``from_pretrained`` is imported on first use, so the converter (``ms-llm convert``) runs without
importing MindSpore (faster start, smaller memory)."""

__all__ = ["from_pretrained"]


def __getattr__(name):
    if name == "from_pretrained":
        from .hf.pretrained import from_pretrained
        return from_pretrained
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
