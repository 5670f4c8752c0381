"""Benchmarks of ms-llm, one module each, run from the checkout as ``python -m benchmarks.<name>``
(``--help`` lists a module's options). ``benchmarks.harness`` holds what they share: worker
launches (plain, msrun, a child interpreter), the standard models and the machine line."""
