"""A transformers model of a registered family's ``tiny_hf`` config with test weights: unit-scale
random matrices (HF's 0.02 init makes routers near-uniform, so routing would hinge on rounding),
norms around 1, biases and DeepSeek-V3's ``e_score_correction_bias`` around 0; float32, eager
attention."""


def build_tiny_hf(family: str, seed: int, **overrides):
    import torch
    import transformers
    from ms_llm.models.registry import get_family
    spec = get_family(family)
    cfg = transformers.AutoConfig.for_model(spec.hf_model_type,
                                            **dict(spec.tiny_hf, **overrides))
    model = getattr(transformers, spec.hf_architecture)(cfg)
    model.config._attn_implementation = "eager"
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1:
                p.copy_(0.6 + 0.8 * torch.rand(p.shape, generator=g) if "norm" in name
                        else 0.3 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn(b.shape, generator=g))
    return model.float().eval()
