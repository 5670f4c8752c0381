"""Context parallel: the sequence split over ``parallel.context_parallel_size`` ranks with ring
attention (``megatron_cp_algo``), Ulysses all-to-all (``ulysses_cp_algo``) or both
(``hybrid_cp_algo``). ``layout`` (who holds which tokens), ``kernel`` (blockwise online-softmax
attention), ``ring`` / ``ulysses`` (the distributed forms), ``apply`` (the model swap and the
batch split)."""
