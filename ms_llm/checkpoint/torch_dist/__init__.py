"""Megatron-Core's ``torch_dist`` checkpoints (``--ckpt-format torch_dist``) without torch: ``io``
reads and writes the folder, ``model`` maps its keys onto ms-llm's names, ``distopt`` reads the
distributed optimizer's state, ``train`` converts a training run's whole state, ``verify``
checks a folder's structure."""
