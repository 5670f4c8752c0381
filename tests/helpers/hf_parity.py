"""One training step's loss and global gradient norm, ms-llm's model against a transformers model
holding the same weights: the shared core of the per-family HF parity tests."""
import numpy as np


def loss_and_grad_norm(hf, model, ids: np.ndarray) -> tuple[float, float, float, float]:
    """(ms-llm loss, HF loss, ms-llm grad norm, HF grad norm) for next-token loss over ``ids``
    [batch, seq] (the last position has no label: masked on our side, shifted off on HF's)."""
    import mindspore as ms
    import torch
    hf.train()
    hf.zero_grad()
    logits = hf(torch.tensor(ids)).logits
    want_loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]),
                                                  torch.tensor(ids[:, 1:]).reshape(-1))
    want_loss.backward()
    want_norm = float(torch.sqrt(sum((p.grad.double() ** 2).sum() for p in hf.parameters()
                                     if p.grad is not None)))
    batch = ids.shape[0]
    labels = np.concatenate([ids[:, 1:], np.zeros((batch, 1), np.int64)], 1).astype(np.int32)
    mask = np.ones(labels.shape, np.float32)
    mask[:, -1] = 0

    def fn(x, y, m):
        return (model(x, labels=y) * m).sum() / m.sum()

    loss, grads = ms.value_and_grad(fn, None, model.trainable_params())(
        ms.Tensor(ids.astype(np.int32)), ms.Tensor(labels), ms.Tensor(mask))
    got_norm = float(np.sqrt(sum((g.asnumpy().astype(np.float64) ** 2).sum() for g in grads)))
    return float(loss.asnumpy()), float(want_loss.detach()), got_norm, want_norm
