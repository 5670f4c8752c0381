"""Megatron-LM's legacy ``torch`` checkpoint folders (``--ckpt-format torch``): ``io`` reads and
writes the weights, ``template`` describes a folder saved without ``args``, ``train`` and
``distopt`` carry a training run's state (optimizer, scheduler, the distributed optimizer's
file) to and from ms-llm's own checkpoint."""
