"""The optimizer interface every training optimizer implements (``Optimizer``), and the base of
optimizers that run another one on tensors of their own (``Wrapper``: fp32 main parameters,
the distributed optimizer's shards).

The trainer, checkpoints and the memory planner talk to an optimizer through this protocol only,
so a new optimizer (Muon) is one class implementing it plus its registration
(``ms_llm.optim.kinds``); nothing probes for attributes.
"""
from __future__ import annotations

from typing import Dict, List, NamedTuple, Optional, Protocol, Sequence, runtime_checkable

import numpy as np
from mindspore import Parameter, Tensor

from ms_llm.parallel.placement import Placement


class StateTensor(NamedTuple):
    """One optimizer-state tensor of a model parameter as a checkpoint stores it:
    ``prefix + <checkpoint name of the parameter>``, the tensor held here, its placement (the
    regions this rank writes/reads follow from it)."""
    prefix: str
    tensor: Parameter
    placement: Placement


@runtime_checkable
class Optimizer(Protocol):
    """What the trainer, ``training.checkpointing`` and ``ms-llm plan`` use.

    ``params`` are the tensors ``step`` updates, aligned with the gradients it takes (the model's
    parameters, their fp32 main copies, or this rank's shards of them); ``grad_sync`` is the
    gradient synchronisation that produces those gradients when the optimizer owns it (the
    distributed optimizer's reduce-scatter), else None; ``groups`` the parameter groups
    (``param_groups.ParamGroup``: printed at start)."""
    params: List[Parameter]
    step_count: int
    grad_sync: Optional[object]
    groups: list

    @property
    def lr(self) -> float: ...

    def step(self, grads: Sequence[Tensor], lr: Optional[float] = None) -> None:
        """One update with ``grads`` (aligned with ``params``) at learning rate ``lr``."""

    def state_tensors(self, param: Parameter) -> List[StateTensor]:
        """The state of model parameter ``param`` held on this rank (none for a buffer, a
        frozen parameter, or an empty shard)."""

    def checkpoint_tensor(self, param: Parameter) -> Optional[Parameter]:
        """What a checkpoint stores as model parameter ``param``: itself, its fp32 main copy
        (bf16 training: resume is exact), or this rank's main shard (None: an empty one)."""

    def load_finished(self) -> None:
        """After a checkpoint load into ``checkpoint_tensor``/``state_tensors``: bring the model
        parameters in line (round fp32 mains into bf16 weights, gather shards)."""

    def state_bytes(self) -> Dict[str, int]:
        """This rank's optimizer-state bytes by kind (``main_params`` included, 0 if none)."""

    def state_dict(self) -> Dict[str, np.ndarray]:
        """The state as named arrays (single process; checkpoints use ``state_tensors``)."""

    def load_state_dict(self, state: Dict[str, np.ndarray], source: str = "optimizer state"
                        ) -> None:
        """The inverse of ``state_dict``; a missing key is one error naming it and ``source``."""


class Wrapper:
    """An optimizer running ``self.inner`` on tensors of its own (fp32 main copies, dp shards):
    step count, learning rate, state dict and ``params`` are the inner optimizer's."""
    inner: Optimizer
    grad_sync: Optional[object] = None

    @property
    def params(self) -> List[Parameter]:
        return self.inner.params

    @property
    def step_count(self) -> int:
        return self.inner.step_count

    @step_count.setter
    def step_count(self, value: int) -> None:
        self.inner.step_count = value

    @property
    def lr(self) -> float:
        return self.inner.lr

    @property
    def groups(self):
        """The inner optimizer's parameter groups (``param_groups.ParamGroup``)."""
        return self.inner.groups

    def state_dict(self) -> Dict[str, np.ndarray]:
        return self.inner.state_dict()

    def load_state_dict(self, state: Dict[str, np.ndarray], source: str = "optimizer state"
                        ) -> None:
        self.inner.load_state_dict(state, source)
