"""Token mixers, one registration per kind (``registry``): softmax attention (``attention``),
multi-head latent attention (``mla``) and Gated DeltaNet (``gated_delta_net``)."""
from .registry import (FULL_ATTENTION, ActivationBytes, MixerKind, full_attention, get_mixer,
                       layer_mixer, mixer_names, mixer_of, mixers_used, register_mixer,
                       validate_mixers)

__all__ = ["FULL_ATTENTION", "ActivationBytes", "MixerKind", "full_attention", "get_mixer",
           "layer_mixer", "mixer_names", "mixer_of", "mixers_used", "register_mixer",
           "validate_mixers"]
