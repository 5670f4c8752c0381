"""Checkpoint formats and conversion: Hugging Face folders, Megatron legacy torch folders
(``megatron``, ``torch_pickle``) and ``ms-llm convert``; the tensor layouts they write live with
the models (``ms_llm.models.layouts``).

``from_pretrained`` is imported on first use, so the converter (``ms-llm convert``) runs without
importing MindSpore (faster start, smaller memory)."""

__all__ = ["from_pretrained"]


def __getattr__(name):
    if name == "from_pretrained":
        from .pretrained import from_pretrained
        return from_pretrained
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
