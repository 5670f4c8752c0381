"""AdamW (``training.optimizer: adamw``, Megatron's ``--optimizer adam``, its default):
decoupled-weight-decay Adam on every parameter (``ms_llm.optim.adamw``), two fp32 moments per
element. Its ``adam_*`` keys also configure the AdamW that Muon runs on the parameters it does
not orthogonalise (``adam_options``)."""
from __future__ import annotations

import functools

from ms_llm.validation import greater_than, one_of, within
from .registry import OptimizerKind, register_optimizer


def adam_options(t) -> dict:
    """AdamW's constructor arguments from the config's ``training`` section."""
    return dict(lr=t.lr, betas=(t.adam_beta1, t.adam_beta2), eps=t.adam_eps,
                weight_decay=t.weight_decay, moments_dtype=t.adam_moments_dtype)


def _build(cfg, groups, pstate, model_config):
    from ..adamw import AdamW
    return functools.partial(AdamW, **adam_options(cfg.training), groups=groups)


ADAMW = register_optimizer(OptimizerKind(
    name="adamw", title="AdamW", build=_build,
    state_elements=lambda name, shape: 2,           # exp_avg, exp_avg_sq
    value_rules={"training.adam_beta1": within(0, 1, hi_open=True),
                 "training.adam_beta2": within(0, 1, hi_open=True),
                 "training.adam_eps": greater_than(0),
                 "training.adam_moments_dtype": one_of("float32", "bfloat16")},
    megatron_names={"adam": {}}))
