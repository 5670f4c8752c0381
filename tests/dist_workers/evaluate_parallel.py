"""Worker for tests/evaluation/test_eval_parallel.py, run under msrun: ``ms-llm evaluate`` itself
(its ``main``, as ``msrun ... ms_llm/cli/evaluate.py`` runs it) with the arguments after argv[0]."""
import sys

from ms_llm.cli.evaluate import main

sys.exit(main(sys.argv[1:]))
