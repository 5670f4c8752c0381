"""Fused one-token decode steps of a transformer layer and of the whole model (``steps``, over
``blas_decode.cpp`` / ``blas_decode_model.cpp``)."""
