"""Test hooks that make failures happen for real, so recovery is tested end to end.

* ``MS_LLM_FAULT_INJECT=STEP:RANK`` -- that rank SIGKILLs itself in the middle of step STEP
  (after forward/backward and the gradient all-reduces, before the optimizer update), as a
  crashed host would: no Python clean-up, no exit message from the worker itself.
* ``MS_LLM_NAN_INJECT=STEP:PARAM_GLOB`` -- at step STEP the gradient of the first parameter whose
  name matches the glob is replaced by NaN (on every rank that holds it), to exercise
  ``training.nan_policy``.

Both fire on the first launch only: ``scripts/pretrain.sh``'s restart loop
(``ms_llm.training.restart``) sets ``MS_LLM_RESTART_ATTEMPT`` to 1, 2, ... for relaunches, and a
relaunch must run the step that failed cleanly or it would fail again every time.
"""
from __future__ import annotations

import fnmatch
import os
import signal
import sys
import time
from typing import Optional, Sequence, Tuple

from ms_llm.compat.environment import variable

FAULT_ENV = "MS_LLM_FAULT_INJECT"
NAN_ENV = "MS_LLM_NAN_INJECT"
ATTEMPT_ENV = "MS_LLM_RESTART_ATTEMPT"


def restart_attempt() -> int:
    """0 on the first launch, k on the k-th automatic relaunch."""
    value = variable(ATTEMPT_ENV) or "0"
    return int(value) if value.isdigit() else 0


def _parse(env: str) -> Optional[Tuple[int, str]]:
    """``STEP:TARGET`` of hook ``env`` (None when unset); a malformed value is an error, not a
    silently disabled hook."""
    value = variable(env)
    if not value:
        return None
    step, sep, target = value.partition(":")
    if not sep or not step.strip().isdigit() or not target.strip():
        what = "RANK" if env == FAULT_ENV else "PARAM_GLOB"
        raise ValueError(f"{env}={value!r}: expected STEP:{what} (e.g. 4:1)")
    return int(step), target.strip()


def fault_target() -> Optional[Tuple[int, int]]:
    """(step, rank) of ``MS_LLM_FAULT_INJECT`` on the first launch, else None."""
    parsed = _parse(FAULT_ENV)
    if parsed is None or restart_attempt() > 0:
        return None
    if not parsed[1].isdigit():
        raise ValueError(f"{FAULT_ENV}={os.environ[FAULT_ENV]!r}: RANK must be an integer")
    return parsed[0], int(parsed[1])


def maybe_kill(step: int, rank: int) -> None:
    """SIGKILL this process when ``MS_LLM_FAULT_INJECT`` names this step and rank."""
    target = fault_target()
    if target is not None and target == (step, rank):
        sys.stdout.write(f"ms-llm: {FAULT_ENV}: rank {rank} SIGKILLs itself in step {step} "
                         f"at unix time {time.time():.3f}\n")
        sys.stdout.flush()
        os.kill(os.getpid(), signal.SIGKILL)


def nan_target() -> Optional[Tuple[int, str]]:
    """(step, parameter glob) of ``MS_LLM_NAN_INJECT`` on the first launch, else None."""
    return None if restart_attempt() > 0 else _parse(NAN_ENV)


def maybe_inject_nan(step: int, names: Sequence[str], grads: list) -> list:
    """``grads`` with the first gradient whose parameter name matches the glob set to NaN
    when ``MS_LLM_NAN_INJECT`` names this step (unchanged otherwise)."""
    target = nan_target()
    if target is None or target[0] != step:
        return grads
    for i, name in enumerate(names):
        if fnmatch.fnmatchcase(name, target[1]):
            out = list(grads)
            out[i] = grads[i] * float("nan")
            sys.stdout.write(f"ms-llm: {NAN_ENV}: gradient of {name} set to NaN at step {step}\n")
            sys.stdout.flush()
            return out
    return grads
