"""Per-token log-probabilities and entropies of a causal LM under the sampling temperature.

The log-prob of token t of a trajectory is log_softmax(logits[t−1] / temperature)[token t]:
the same tempered distribution the rollout engine sampled from (vLLM reports log-probs
after temperature), so that ρ = π_θ/π_θold compares like with like. Computed in float32
whatever the model dtype, in chunks of positions so that the float32 copy of the logits
never exceeds one chunk.

Legend: B = rows, T = positions, V = vocabulary.
"""

from __future__ import annotations

import torch

#: Positions per chunk when converting logits to float32.
DEFAULT_CHUNK = 1024


def token_logprobs(
    logits_BTV: torch.Tensor, targets_BT: torch.Tensor, temperature: float = 1.0, chunk: int = DEFAULT_CHUNK
) -> torch.Tensor:
    """log softmax(logits / temperature) at the target ids.

    Args:
        logits_BTV: [B, T, V] logits predicting position t+1 from position t (already shifted:
            row t of the logits is paired with targets_BT[:, t]).
        targets_BT: [B, T] int64 token ids.
        temperature: sampling temperature (> 0), the engine's.
        chunk: positions converted to float32 at a time.

    Returns:
        logp_BT: [B, T] float32, differentiable w.r.t. the logits.

    Raises:
        ValueError: temperature <= 0 or mismatched shapes.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if logits_BTV.shape[:2] != targets_BT.shape:
        raise ValueError(f"logits {tuple(logits_BTV.shape)} and targets {tuple(targets_BT.shape)} do not match")
    out = []
    for s in range(0, targets_BT.shape[1], chunk):
        z_BCV = logits_BTV[:, s : s + chunk].float()
        if temperature != 1.0:
            z_BCV = z_BCV / temperature
        picked_BC = z_BCV.gather(-1, targets_BT[:, s : s + chunk, None]).squeeze(-1)
        out.append(picked_BC - torch.logsumexp(z_BCV, dim=-1))
    return torch.cat(out, dim=1)


@torch.no_grad()
def token_entropy(logits_BTV: torch.Tensor, temperature: float = 1.0, chunk: int = DEFAULT_CHUNK) -> torch.Tensor:
    """Entropy (nats) of softmax(logits / temperature) at each position; no gradient.

    Args:
        logits_BTV: [B, T, V] logits.

    Returns:
        [B, T] float32 entropies H = logsumexp(z) − Σ softmax(z)·z.
    """
    out = []
    for s in range(0, logits_BTV.shape[1], chunk):
        z_BCV = logits_BTV[:, s : s + chunk].float()
        if temperature != 1.0:
            z_BCV = z_BCV / temperature
        lse_BC = torch.logsumexp(z_BCV, dim=-1)
        out.append(lse_BC - (torch.softmax(z_BCV, dim=-1) * z_BCV).sum(-1))
    return torch.cat(out, dim=1)
