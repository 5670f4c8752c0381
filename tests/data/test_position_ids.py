"""Packed documents: with restarting ``position_ids`` and the per-document causal mask, each
document's logits equal those of the document run alone (what data.reset_position_ids and
data.reset_attention_mask promise). Tolerance 2e-5 relative to the logits' scale: the same fp32
arithmetic over a shorter/longer softmax row (masked entries are exact zeros)."""
import numpy as np
from mindspore import Tensor

from ms_llm.data.packing import ltor_masks_and_position_ids
from ms_llm.models import GPTModel
from ms_llm.models.config import TransformerConfig

CFG = TransformerConfig(num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4,
                        num_query_groups=2, kv_channels=16, padded_vocab_size=97,
                        untie_embeddings_and_output_weights=True)
EOD = 0


def _logits(model, ids, mask=None, pos=None):
    return model(Tensor(ids[None].astype(np.int32)),
                 attention_mask=None if mask is None else Tensor(mask[None]),
                 position_ids=None if pos is None else Tensor(pos[None].astype(np.int32))
                 ).asnumpy()[0]


def test_packed_documents_match_separate_runs():
    rng = np.random.default_rng(0)
    a = np.concatenate([rng.integers(1, 97, 7), [EOD]])
    b = rng.integers(1, 97, 9)
    packed = np.concatenate([a, b])
    mask, _, pos = ltor_masks_and_position_ids(packed, EOD, True, True, False)
    assert pos[len(a)] == 0                       # the second document restarts at 0
    model = GPTModel(CFG)
    model.set_train(False)
    got = _logits(model, packed, mask, pos)
    alone_a, alone_b = _logits(model, a), _logits(model, b)
    scale = np.abs(alone_b).max()
    np.testing.assert_allclose(got[:len(a)], alone_a, atol=2e-5 * scale, rtol=0)
    np.testing.assert_allclose(got[len(a):], alone_b, atol=2e-5 * scale, rtol=0)
    # RoPE is relative, so under the document mask the restart changes only rounding; without
    # the mask the second document attends across the boundary and the restart is visible.
    restarted, plain = _logits(model, packed, None, pos), _logits(model, packed)
    np.testing.assert_allclose(restarted[:len(a)], plain[:len(a)], atol=2e-5 * scale, rtol=0)
    assert np.abs(restarted[len(a):] - plain[len(a):]).max() > 1e-3 * scale
