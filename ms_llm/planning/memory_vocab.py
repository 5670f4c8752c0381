"""The memory of a large vocabulary's output layer and embedding gradients that ``memory_plan``'s
per-layer activation copies and plain gradient count miss (issue 31: Qwen3-0.6B, vocab 151936,
hidden 1024, measured 1.45-1.5x the plan before these terms).

Measured on MindSpore 2.10's CPU backend, PyNative, fp32, one process (``benchmarks/memory.py``
and the output layer + cross entropy alone at [512 tokens, 151936 x 1024]):

* the output layer's weight gradient ``[V, h]`` is the first gradient the backward forms, while
  every activation (and the logits' gradient) is still held: it adds to the activation phase;
* with tied embeddings the embedding's gather produces a dense ``[V, h]`` gradient at the end of
  the backward, summed with the output layer's: two more ``[V, h]`` tensors beside the
  gradients at that moment (the output layer + cross entropy alone at 512 tokens: 1.52 GiB
  peak untied-head-only, 2.11 tied, i.e. 2.63 and 3.64 copies of the 0.58 GiB weight);
* from the second step on, MindSpore's CPU allocator holds more than the first step's peak
  (freed blocks of one size are not all reused for others): ``regrowth`` copies of ``[V, h]``,
  fitted on the 4- and 8-layer proxies of Qwen3-0.6B (the step-1 -> step-2 growth).

With ``model.cross_entropy_loss_fusion`` (``ops.fused_cross_entropy``) the logits exist one
chunk of tokens at a time (``logits_tokens``), and the op's backward forms the ``[V, h]``
gradient as a sum over those chunks: its own ``VOCAB_FUSED`` copies, fitted on the 4-layer proxy.

Under tensor or pipeline parallel these were not measured and are not added (the
vocabulary-parallel head's copies are ``ACT["logits_tp"]``).
"""
from __future__ import annotations

from typing import Tuple

from ms_llm.models.config import TransformerConfig

FP32 = 4
VOCAB = {
    "dw_early": 1.0,    # [V, h]: the output layer's weight gradient during the backward
    "tied_sum": 2.0,    # tied: the embedding's dense gradient and the sum with the head's
    "regrowth": 1.5,    # the allocator's growth after the first step (fitted, see above)
}
# The fused op's backward: the running [V, h] sum, the chunk's product and their sum exist at
# once (the op alone at 512 tokens, tied: 1.92 GiB peak against the plain head's 2.11); the
# allocator's step-1 -> step-2 growth on the 4-layer proxy with the flag was 0.61 GiB (1.0 [V, h]);
# measured 5.27 GiB peak, planned 5.61 (the gradient phase is the larger one).
FUSED_DW_EARLY = 2.0
FUSED_REGROWTH = 1.0


VOCAB_FUSED = dict(VOCAB, dw_early=FUSED_DW_EARLY, regrowth=FUSED_REGROWTH)


def logits_tokens(c: TransformerConfig, tokens: int, tp: int) -> int:
    """Tokens whose ``[T, V]`` logits exist at once: all of them, or one chunk of the fused
    output layer + cross entropy (``fused_cross_entropy.chunk_tokens_for``)."""
    if not c.cross_entropy_loss_fusion or tp != 1:
        return tokens
    from ms_llm.ops.fused_cross_entropy import chunk_tokens_for
    return min(tokens, chunk_tokens_for(c.padded_vocab_size))


def vocab_head_bytes(c: TransformerConfig, tp: int, pp: int) -> Tuple[int, int]:
    """(added to the activation phase, added to the gradient phase) in bytes for a one-stage,
    ``tp == 1`` run (plain or fused output layer); (0, 0) for the layouts not measured."""
    if tp != 1 or pp != 1:
        return 0, 0
    k = VOCAB_FUSED if c.cross_entropy_loss_fusion else VOCAB
    unit = FP32 * c.padded_vocab_size * c.hidden_size
    tied = not c.untie_embeddings_and_output_weights
    late = k["tied_sum"] if tied else 0.0
    return int(unit * (k["dw_early"] + k["regrowth"])), int(unit * (late + k["regrowth"]))
