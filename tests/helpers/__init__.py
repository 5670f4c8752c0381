"""Code the tests share: fixtures (tiny HF folders, corpora, tokenizers), independent references
(NumPy forwards of the HF models, the MX spec), the tiny runs of the msrun workers and the
launchers of subprocesses (``ms-llm``, msrun, scripts/pretrain.sh). Test modules import from here,
never from one another; ``tests/conftest.py`` puts ``tests/`` on ``sys.path``."""
