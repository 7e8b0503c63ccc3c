"""Per-token log-probabilities and entropies of a causal LM under the sampling temperature.

The log-prob of token t of a trajectory is log_softmax(logits[t−1] / temperature)[token t]:
the same tempered distribution the rollout engine sampled from (vLLM reports log-probs
after temperature), so that ρ = π_θ/π_θold compares like with like. Computed in float32
whatever the model dtype, in chunks of positions so that the float32 copy of the logits
never exceeds one chunk.

Top-k / top-p (`picked_logprobs(top_k=, top_p=)`): vLLM's ``processed_logprobs`` are the
log-probs of the distribution it sampled from after its top-k and top-p masks, renormalised
over the kept tokens (vllm/v1/sample/ops/topk_topp_sampler.py, `apply_top_k_top_p`: top-k keeps
the tokens whose tempered logit is >= the k-th largest, ties kept; top-p then sorts the kept
tokens ascending and drops those whose cumulative probability is <= 1 − p, the largest always
kept). The learner applies the same masks (`kept_mask`) to its own tempered logits and takes
the log-softmax over the kept set; the masks carry no gradient. A picked target outside its
row's kept set (the two sides' rounding disagreeing at the boundary) is added to the set, so
its log-prob stays finite.

Legend: B = rows, T = positions, V = vocabulary.
"""

from __future__ import annotations

import torch

from learner_service.batch import PickedBatch

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
        out.append(_lse_and_entropy(z_BCV)[1])
    return torch.cat(out, dim=1)


def _lse_and_entropy(z_CV: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """log-sum-exp and entropy (nats) over the last dimension, with one exp pass.

    With m = max z, e = exp(z − m), s = Σ e: lse = m + log s and H = lse − Σ e·z / s
    (= logsumexp(z) − Σ softmax(z)·z). `torch.logsumexp` followed by `torch.softmax` would take
    the maximum and the exponentials twice; on the demo's learner step (≈5k rows × 49,152
    vocabulary) that second pass was ~6 % of the step. Agrees with the float64 reference to
    float32 rounding (tests/test_grpo_loss.py).

    Args:
        z_CV: [..., V] float32 or float64 logits (already divided by the temperature).

    Returns:
        (lse [...], entropy [...]) in z's dtype.
    """
    m_C1 = z_CV.amax(dim=-1, keepdim=True)
    e_CV = torch.sub(z_CV, m_C1).exp_()
    s_C = e_CV.sum(dim=-1)
    lse_C = m_C1.squeeze(-1) + s_C.log()
    return lse_C, lse_C - torch.linalg.vecdot(e_CV, z_CV) / s_C


def _math_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def kept_mask(z_CV: torch.Tensor, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor | None:
    """vLLM's top-k then top-p masks of tempered logits (see the module docstring).

    Args:
        z_CV: [C, V] float logits already divided by the temperature.
        top_k: keep the k largest (<= 0 or >= V: all).
        top_p: keep the smallest top set of probability >= p (1: all).

    Returns:
        [C, V] bool, True where kept; None when nothing is masked.
    """
    v = z_CV.shape[-1]
    keep = None
    if 0 < top_k < v:
        kth_C1 = z_CV.topk(top_k, dim=-1).values[..., -1:]
        keep = z_CV >= kth_C1
    if top_p < 1.0:
        zk_CV = z_CV if keep is None else z_CV.masked_fill(~keep, float("-inf"))
        sorted_CV, idx_CV = zk_CV.sort(dim=-1, descending=False)
        cum_CV = sorted_CV.softmax(dim=-1).cumsum(dim=-1)
        drop_sorted = cum_CV <= 1 - top_p
        drop_sorted[..., -1] = False  # at least one
        drop_CV = torch.zeros_like(drop_sorted).scatter_(-1, idx_CV, drop_sorted)
        keep = ~drop_CV if keep is None else keep & ~drop_CV
    return keep


def _truncated(z_CV: torch.Tensor, top_k: int, top_p: float, rows_P: torch.Tensor | None = None,
               targets_P: torch.Tensor | None = None) -> torch.Tensor:
    """z with -inf outside the kept set (`kept_mask`), the picks (rows_P, targets_P of this chunk) always kept."""
    keep = kept_mask(z_CV, top_k, top_p)
    if keep is None:
        return z_CV
    if rows_P is not None and rows_P.numel():
        keep[rows_P, targets_P] = True
    return z_CV.masked_fill(~keep, float("-inf"))


def _picks_in(rows_K: torch.Tensor, targets_K: torch.Tensor, idx_C: torch.Tensor, n: int):
    """The picks whose row is one of `idx_C` (rows of a chunk, of N), as (position in idx_C, target)."""
    pos_N = torch.full((n,), -1, dtype=torch.long, device=rows_K.device)
    pos_N[idx_C] = torch.arange(idx_C.numel(), device=rows_K.device)
    local_K = pos_N[rows_K]
    sel = local_K >= 0
    return local_K[sel], targets_K[sel]


class _PickedLogProbs(torch.autograd.Function):
    """log softmax(z / τ)[target] at K (row, target) picks of [N, V] logits, chunked, fp32.

    Forward: per chunk of rows, z = logits.float() / τ, lse = logsumexp(z), entropy (no grad);
    logp_k = z[row_k, target_k] − lse[row_k]. Only the logits and lse [N] are saved.
    Backward (recomputed per chunk; never more than one chunk in float32):
        dL/dlogits[n] = (Σ_{k: row_k = n} g_k · onehot(target_k) − (Σ_{k: row_k = n} g_k) · softmax(z_n)) / τ
    Rows no pick with a non-zero gradient points at are skipped (their gradient is 0).
    With top-k / top-p, z is -inf outside each row's kept set (`_truncated`) in both passes.
    """

    @staticmethod
    def forward(ctx, logits_NV, rows_K, targets_K, temperature, chunk, want_entropy, top_k=0, top_p=1.0):
        n = logits_NV.shape[0]
        math = _math_dtype(logits_NV.dtype)
        truncate = top_k > 0 or top_p < 1.0
        lse_N = torch.empty(n, dtype=math, device=logits_NV.device)
        ent_N = torch.empty(n, dtype=math, device=logits_NV.device) if want_entropy else None
        for s in range(0, n, chunk):
            z_CV = logits_NV[s : s + chunk].to(math)
            if temperature != 1.0:
                z_CV = z_CV / temperature
            if truncate:
                z_CV = _truncated(z_CV, top_k, top_p, *_picks_in(rows_K, targets_K, torch.arange(s, min(s + chunk, n), device=rows_K.device), n))
                lse_C = torch.logsumexp(z_CV, dim=-1)
                lse_N[s : s + chunk] = lse_C
                if ent_N is not None:
                    p_CV = torch.exp(z_CV - lse_C[:, None])
                    ent_N[s : s + chunk] = lse_C - (p_CV * z_CV.masked_fill(p_CV == 0, 0.0)).sum(-1)
            elif ent_N is None:
                lse_N[s : s + chunk] = torch.logsumexp(z_CV, dim=-1)
            else:
                lse_N[s : s + chunk], ent_N[s : s + chunk] = _lse_and_entropy(z_CV)
        picked_K = logits_NV[rows_K, targets_K].to(math) / temperature
        ctx.save_for_backward(logits_NV, lse_N, rows_K, targets_K)
        ctx.meta = (temperature, chunk, top_k, top_p)
        if ent_N is None:
            ent_N = torch.zeros(0, device=logits_NV.device)
        ctx.mark_non_differentiable(ent_N)
        return picked_K - lse_N[rows_K], ent_N

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_K, _grad_ent):
        logits_NV, lse_N, rows_K, targets_K = ctx.saved_tensors
        temperature, chunk, top_k, top_p = ctx.meta
        truncate = top_k > 0 or top_p < 1.0
        n = logits_NV.shape[0]
        g_K = grad_K.to(lse_N.dtype) / temperature
        gsum_N = torch.zeros(n, dtype=lse_N.dtype, device=g_K.device).index_add_(0, rows_K, g_K)
        grad_NV = torch.zeros_like(logits_NV)
        live = (gsum_N != 0).nonzero().flatten()
        for s in range(0, live.numel(), chunk):
            idx = live[s : s + chunk]
            z_CV = logits_NV[idx].to(lse_N.dtype)
            if temperature != 1.0:
                z_CV = z_CV / temperature
            if truncate:
                z_CV = _truncated(z_CV, top_k, top_p, *_picks_in(rows_K, targets_K, idx, n))
            p_CV = torch.exp(z_CV - lse_N[idx, None])
            grad_NV[idx] = (p_CV.mul_(-gsum_N[idx, None])).to(grad_NV.dtype)
        grad_NV.index_put_((rows_K, targets_K), g_K.to(grad_NV.dtype), accumulate=True)
        return grad_NV, None, None, None, None, None, None, None


def picked_logprobs(
    logits_NV: torch.Tensor,
    rows_K: torch.Tensor,
    targets_K: torch.Tensor,
    temperature: float = 1.0,
    chunk: int = DEFAULT_CHUNK,
    entropy: bool = False,
    top_k: int = 0,
    top_p: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Tempered log-probs at K (row, target) picks of flat logits; several picks may share a row.

    The shared-prefix batch needs this: the last prefix position is one logits row with G
    different targets (each suffix's first token), and every prefix position's row serves
    all G rollouts. Each row's log-sum-exp is computed once, in float32, in chunks of rows;
    the backward recomputes softmax chunk by chunk (custom autograd, `_PickedLogProbs`), so
    neither pass keeps a float32 copy of the logits, and rows without gradient are skipped.

    Args:
        logits_NV: [N, V] logits (any float dtype; bf16 under autocast), rows = positions.
        rows_K: [K] int64 row of each pick; targets_K: [K] int64 token id of each pick.
        temperature: the engine's sampling temperature (> 0).
        chunk: rows converted to float32 at a time.
        entropy: also return the per-row entropy [N] float32 (no gradient; of the truncated
            distribution when top_k / top_p truncate).
        top_k, top_p: the engine's top-k (<= 0: none) and top-p (1: none): log-probs over the
            kept set, as vLLM's processed log-probs (module docstring).

    Returns:
        (logp_K [K] float32 (float64 for float64 logits), differentiable w.r.t. the logits;
        entropy_N [N] in the same dtype, or None).
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if logits_NV.dim() != 2 or rows_K.shape != targets_K.shape or rows_K.dim() != 1:
        raise ValueError(f"need logits [N, V] and rows/targets [K]; got {tuple(logits_NV.shape)}, "
                         f"{tuple(rows_K.shape)}, {tuple(targets_K.shape)}")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    logp_K, ent_N = _PickedLogProbs.apply(logits_NV, rows_K, targets_K, float(temperature), int(chunk), bool(entropy),
                                          int(top_k), float(top_p))
    return logp_K, (ent_N if entropy else None)


def rollout_logprobs(
    logits_NV: torch.Tensor,
    pb: PickedBatch,
    temperature: float = 1.0,
    entropy: bool = False,
    top_k: int = 0,
    top_p: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The log-probs of a `batch.PickedBatch`'s rollouts, from its flattened kept logits.

    Args:
        logits_NV: [B·J, V] the model's logits at the batch's kept columns (`pb.keep_J`), flattened.
        pb: the batch: picks (`pick_row_K`, `pick_target_K`), `src_RT`, `mask_RT`.
        temperature: the engine's sampling temperature (> 0); 1.0: the model's own distribution.
        entropy: also return the entropy at each rollout position.
        top_k, top_p: the engine's top-k / top-p (`picked_logprobs`; 0 and 1: none).

    Returns:
        (logp_RT [R, T] float32 (float64 for float64 logits), 0 off the loss mask, differentiable;
        entropy_RT [R, T] of the row each position reads (no gradient), or None).
    """
    logp_K, ent_N = picked_logprobs(logits_NV, pb.pick_row_K, pb.pick_target_K, temperature, entropy=entropy,
                                    top_k=top_k, top_p=top_p)
    logp_RT = torch.where(pb.mask_RT, logp_K[pb.src_RT], torch.zeros((), dtype=logp_K.dtype, device=logp_K.device))
    ent_RT = None if ent_N is None else ent_N[pb.pick_row_K[pb.src_RT]]
    return logp_RT, ent_RT
