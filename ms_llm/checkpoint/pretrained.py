"""``from_pretrained``: build a GPTModel from a Hugging Face folder (Megatron folders: issue 3)."""
from __future__ import annotations

import logging
import os
from typing import Optional

import numpy as np

from ms_llm.compat import load_state_dict, to_ms_dtype
from ms_llm.models.config import TransformerConfig
from ms_llm.models.families import config_from_hf
from ms_llm.models.gpt import GPTModel
from .hf_io import read_hf_config, read_hf_weights
from .hf_mapping import hf_to_mcore

log = logging.getLogger("ms_llm.checkpoint")


def from_pretrained(path: str, dtype: Optional[str] = None,
                    config: Optional[TransformerConfig] = None) -> GPTModel:
    """Load a Hugging Face folder (``config.json`` + safetensors, fp32/bf16/fp16) into a GPTModel.

    ``dtype`` is the parameter dtype (default float32, which also is the only compute dtype with
    kernels everywhere on CPU); ``config`` overrides the architecture read from config.json.
    """
    hf_cfg = read_hf_config(path)
    cfg = config or config_from_hf(hf_cfg, source=os.path.join(path, "config.json"))
    if dtype is not None:
        to_ms_dtype(dtype)  # validates the name
        cfg = cfg.replace(params_dtype=dtype)
    hf = read_hf_weights(path)
    # Fuse in fp32: every supported storage dtype converts to fp32 exactly.
    hf32 = {k: np.asarray(v, dtype=np.float32) for k, v in hf.items()}
    mcore = hf_to_mcore(hf32, cfg, source=path)
    model = GPTModel(cfg)
    load_state_dict(model, mcore, strict=True, source=path)
    log.info("loaded %s: %d parameters", path, model.num_parameters())
    return model
