"""Optimizer kernels: AdamW's in-place update (``optim_kernels.cpp``, through
``model.functional.adamw_update``) and Muon's Newton-Schulz as one op (``muon_ns``)."""
