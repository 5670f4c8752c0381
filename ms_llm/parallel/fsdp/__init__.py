"""HyperParallel/FSDP2-style ``fully_shard`` with non-uniform dim-0 sharding (PyNative)."""
from .apply import apply_fsdp, fsdp_group
from .fully_shard import FSDPModule, MixedPrecisionPolicy, fully_shard
from ..placement import RowShard

__all__ = ["apply_fsdp", "fsdp_group", "fully_shard", "FSDPModule", "MixedPrecisionPolicy",
           "RowShard"]
