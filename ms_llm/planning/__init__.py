"""Planning a run before (and while) it runs: per-rank memory (``memory_plan``, with each token
mixer's own term from its registration and the vocabulary's in ``memory_vocab``, and the cheapest
change that makes a layout fit in ``memory_plan_fit``), model FLOPs (``flops``) and the CPU GEMM
peak the MFU is measured against (``peak``). It reads a run config and asks ``parallel`` how the
model is split; ``training`` reports through it."""
