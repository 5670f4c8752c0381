"""Matrix products: the OpenBLAS library's ops (``blas``: linear, bmm, and the attention ops'
Python face) and the choice of bf16 GEMM (``bf16``, oneDNN's in ``dnnl``)."""
