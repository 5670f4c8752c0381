"""MindSpeed-LLM / Megatron command lines as ms-llm run configs.

A MindSpeed user's job is a shell script of Megatron flags launched as
``torchrun $DISTRIBUTED_ARGS pretrain_gpt.py ...`` (``posttrain_gpt.py`` for fine-tuning). The
``pretrain_gpt.py`` / ``posttrain_gpt.py`` files at the repository root take that argument list
unchanged under ``msrun``: ``flags`` maps every flag to a key of the one run-config schema
(``ms_llm.config``), accepts it as a no-op with the reason, or refuses it in one line naming it.
"""
