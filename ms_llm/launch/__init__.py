"""Launching processes: ``msrun`` (the one msrun launcher: command line, port, environment, logs,
bounded wait). Like ``compat``, it imports nothing from ``ms_llm`` above it and no MindSpore, so a
supervisor process that only launches stays light and any package may use it. The restart
supervisor (``training.restart``) stays with ``training``: it reads the fault-injection attempt
variable of ``training.faults`` and the newest checkpoint of ``checkpoint``."""
