"""The kernels of the model's layers: the main library's fused ops (``functional``, over
``kernels.cpp`` and the bf16 residual stream's ``stream_kernels.cpp``; ``composed`` is their
MindSpore fallback) and the BLAS library's attention (``blas_attention.cpp``,
``blas_pair_attention.cpp``) and dropless MoE (``blas_moe``)."""
