"""Router margins: when expert ids from forwards of different shapes can be compared exactly."""

from __future__ import annotations

import torch

from refpipe.job.workload.model import MoELM, MoEMLP

# Packed and alone forwards run different matmul shapes, so router logits differ by ~1e-6 between them
# (AVX2 vs AVX-512 blockings). Expert ids compare exactly only where no top-k choice is that close.
ROUTER_MARGIN = 1e-4


def router_margin(model: MoELM, *inputs: torch.Tensor) -> float:
    """Smallest gap, over tokens and layers of ``model(*inputs)``, between the k-th and (k+1)-th router logit."""
    gaps: list[float] = []

    def record(layer: MoEMLP, _args, router_logits: torch.Tensor) -> None:
        top = router_logits.topk(layer.top_k + 1, dim=-1).values
        gaps.append(float((top[:, -2] - top[:, -1]).min()))

    layers = [m for m in model.modules() if isinstance(m, MoEMLP)]
    hooks = [layer.router.register_forward_hook(lambda _m, a, out, layer=layer: record(layer, a, out))
             for layer in layers]
    try:
        with torch.no_grad():
            model(*inputs)
    finally:
        for hook in hooks:
            hook.remove()
    return min(gaps)
