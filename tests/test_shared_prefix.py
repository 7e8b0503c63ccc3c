"""Shared-prefix groups: the mask, the packing, and exactness against unshared rows (tiny models, CPU).

Float64 exactness needs float64 throughout: transformers' RMSNorms compute in float32
whatever the model dtype, so the `float64_norms` fixture (tests/fixtures/learner.py) lets them keep float64 inputs
(the only change to the models), and gpt-oss's experts run eagerly (grouped_mm has no float64).
"""

from __future__ import annotations

import pytest
import torch

from learner_service.batch import common_prefix_len, pack_shared, rollouts_from_group
from learner_service.logprobs import rollout_logprobs
from learner_service.loss import grpo_loss
from learner_service.trainer import Learner
from sinkflex.attention import generate_shared_prefix
from sinkflex.attention.blockwise import blockwise_sink_attention
from sinkflex.attention.reference import reference_sink_attention
from tests.fixtures.learner import TINY_GPT_OSS, TINY_LLAMA, learner_config, make_group

pytestmark = pytest.mark.usefixtures("torch_one_thread")

GPT_OSS_F64 = dict(TINY_GPT_OSS, experts_implementation="eager")  # window 4 < the prefix below


def _layout(P, lengths):
    seg = [0] * P + [s + 1 for s, n in enumerate(lengths) for _ in range(n)]
    return torch.tensor([seg])


def _alone_dense(P, lengths, window):
    """The mask built the slow way: each rollout alone, causal (+ window) on its own positions."""
    N = P + sum(lengths)
    allowed = torch.zeros(N, N, dtype=torch.bool)
    cols = []
    a = P
    for n in lengths:
        cols.append(list(range(P)) + list(range(a, a + n)))  # packed columns of rollout s, in order
        a += n
    for rollout_cols in cols:
        for i, qi in enumerate(rollout_cols):
            for j, kj in enumerate(rollout_cols[: i + 1]):
                if window is None or j > i - window:
                    allowed[qi, kj] = True
    return allowed


@pytest.mark.parametrize("window", [None, 1, 3, 8])
def test_mask_is_each_rollout_alone(window):
    P, lengths = 6, [4, 0, 5, 2]
    spec = generate_shared_prefix(_layout(P, lengths), window=window)
    N = P + sum(lengths)
    assert torch.equal(spec.dense(1, N, N, torch.device("cpu"))[0], _alone_dense(P, lengths, window))
    # tile hints: intervals cover every allowed key and never another suffix; full tiles are full
    dense = _alone_dense(P, lengths, window)
    for q0 in range(N):
        for q1 in range(q0 + 1, min(q0 + 5, N) + 1):
            ivs = spec.key_intervals(q0, q1, N)
            covered = torch.zeros(N, dtype=torch.bool)
            for lo, hi in ivs:
                covered[lo:hi] = True
            assert not (dense[q0:q1].any(0) & ~covered).any(), (q0, q1, ivs)
            for k0 in range(N):
                for k1 in range(k0 + 1, min(k0 + 4, N) + 1):
                    if spec.tile_is_full(q0, q1, k0, k1):
                        assert dense[q0:q1, k0:k1].all(), (q0, q1, k0, k1)
    # a query of suffix 3 never visits suffix 1's keys
    a3 = P + lengths[0] + lengths[1]
    for lo, hi in spec.key_intervals(a3, a3 + lengths[2], N):
        assert hi <= P or lo >= a3


@pytest.mark.parametrize("window", [None, 3])
@pytest.mark.parametrize("tile", [1, 2, 5, 64])
def test_blockwise_matches_reference_float64(window, tile):
    P, lengths = 7, [5, 3, 6]
    N = P + sum(lengths)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 4, N, 8, dtype=torch.float64, generator=g, requires_grad=True)
    k = torch.randn(1, 2, N, 8, dtype=torch.float64, generator=g, requires_grad=True)
    v = torch.randn(1, 2, N, 8, dtype=torch.float64, generator=g, requires_grad=True)
    sinks = torch.randn(4, dtype=torch.float64, generator=g, requires_grad=True)
    spec = generate_shared_prefix(_layout(P, lengths), window=window)
    ref = reference_sink_attention(q, k, v, sinks, spec, 0.3)[0]
    out = blockwise_sink_attention(q, k, v, sinks, spec, 0.3, q_tile=tile, kv_tile=tile + 1)
    w = torch.randn(ref.shape, dtype=torch.float64, generator=g)
    g_ref = torch.autograd.grad((ref * w).sum(), (q, k, v, sinks))
    g_out = torch.autograd.grad((out * w).sum(), (q, k, v, sinks))
    assert (out - ref).abs().max() <= 1e-12
    assert max((a - b).abs().max().item() for a, b in zip(g_ref, g_out)) <= 1e-12


@pytest.mark.parametrize("pad_budget", [0.0, 1.3, 100.0], ids=["per-suffix", "bucketed", "batched"])
@pytest.mark.parametrize("P, lengths", [(5, [3, 4, 1]), (0, [2, 5]), (6, [1]), (4, [9, 2, 8, 2, 3, 9, 1])])
def test_sdpa_route_matches_reference_float64(monkeypatch, pad_budget, P, lengths):
    """Every SDPA form of the suffixes (one call per suffix; buckets of similar length; one
    padded batched call) is exact, outputs in suffix order whatever the buckets."""
    from sinkflex.attention import sdpa
    from sinkflex.attention.sdpa import sdpa_shared_prefix_attention

    monkeypatch.setattr(sdpa, "_PAD_BUDGET", pad_budget)
    N = P + sum(lengths)
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, h, N, 8, dtype=torch.float64, generator=g, requires_grad=True) for h in (4, 2, 2))
    spec = generate_shared_prefix(_layout(P, lengths))
    ref = reference_sink_attention(q, k, v, None, spec, 0.35)[0]
    out = sdpa_shared_prefix_attention(q, k, v, spec, 0.35)
    assert (out - ref).abs().max() <= 1e-12
    g_ref = torch.autograd.grad(ref.square().sum(), (q, k, v))
    g_out = torch.autograd.grad(out.square().sum(), (q, k, v))
    assert max((a - b).abs().max().item() for a, b in zip(g_ref, g_out)) <= 1e-12


def test_sdpa_causal_matches_reference_and_refuses_what_it_cannot_express():
    """The SDPA backend's causal form against the reference (float64, GQA); a shared-prefix mask
    with a window or with padding is refused, not approximated."""
    from sinkflex.attention import generate_causal
    from sinkflex.attention.sdpa import sdpa_causal_attention, sdpa_shared_prefix_attention, supports_shared_prefix

    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(2, h, 11, 8, dtype=torch.float64, generator=g, requires_grad=True) for h in (4, 2, 2))
    ref = reference_sink_attention(q, k, v, None, generate_causal(), 0.3)[0]
    out = sdpa_causal_attention(q, k, v, 0.3)
    assert (out - ref).abs().max() <= 1e-12
    g_ref = torch.autograd.grad(ref.square().sum(), (q, k, v))
    g_out = torch.autograd.grad(out.square().sum(), (q, k, v))
    assert max((a - b).abs().max().item() for a, b in zip(g_ref, g_out)) <= 1e-12
    seg = _layout(3, [2, 4])
    assert supports_shared_prefix(generate_shared_prefix(seg))
    padded = torch.cat([seg, torch.full((1, 2), -1)], dim=1)
    for spec in (generate_shared_prefix(seg, window=2), generate_shared_prefix(padded), generate_causal()):
        assert not supports_shared_prefix(spec)
        with pytest.raises(ValueError, match="shared-prefix masks without window or padding"):
            sdpa_shared_prefix_attention(q[:1], k[:1], v[:1], spec, 0.3)


def test_length_buckets():
    from sinkflex.attention import sdpa
    from sinkflex.attention.sdpa import _length_buckets

    assert _length_buckets(100, [120, 118, 125, 121]) == [[1, 0, 3, 2]]  # a group: one call
    b = _length_buckets(850, [100, 400, 110, 390, 105, 1200])  # many groups' rollouts
    assert sorted(j for bucket in b for j in bucket) == list(range(6))
    assert b == [[0, 4, 2], [3, 1], [5]]
    for bucket in b:  # padding within each bucket is inside the budget
        n = [[100, 400, 110, 390, 105, 1200][j] for j in bucket]
        assert len(n) * max(n) * (850 + max(n)) <= sdpa._PAD_BUDGET * sum(x * (850 + x) for x in n)
    assert _length_buckets(5, []) == []


def _groups():
    # prompts of 9 tokens (longer than gpt-oss's window 4), suffixes of different lengths; the
    # generated tokens start right after the prompt, so the last prefix position has G targets.
    return [
        make_group("a", [0.0, 1.0, 0.3, 0.7], seed=4, prompt_len=9, lengths=[14, 20, 12, 17]),
        make_group("b", [1.0, 0.0, 0.5], seed=5, prompt_len=9, lengths=[15, 11, 10]),
    ]


def test_pack_shared_layout_and_fallback():
    rollouts, _ = rollouts_from_group(_groups()[0])
    idx = list(range(len(rollouts)))
    assert common_prefix_len(rollouts, idx) == 9
    pb = pack_shared(rollouts, idx, min_prefix=1)
    assert pb.prefix_len == 9 and pb.positions_computed == 9 + sum(r.num_positions - 9 for r in rollouts)
    # position ids continue from the prefix in every suffix
    pos, seg = pb.position_ids_BN[0], pb.segment_ids_BN[0]
    for s in range(1, 5):
        assert pos[seg == s].tolist() == list(range(9, 9 + int((seg == s).sum())))
    # the last prefix position: one logits row, one pick per rollout, each with its own target
    boundary = pb.src_RT[:, 8]
    assert len(set(boundary.tolist())) == 4
    assert len(set(pb.pick_row_K[boundary].tolist())) == 1
    assert pb.pick_target_K[boundary].tolist() == [int(r.token_ids_T[9]) for r in rollouts]
    assert pack_shared(rollouts, idx, min_prefix=10) is None  # too short to pay
    assert pack_shared(rollouts, idx[:1]) is None  # nothing to share


def _loss_and_grads(arch, dtype, shared, groups, gc=False, weights=None):
    cfg = learner_config("/tmp/unused", arch, batch=dict(shared_prefix=shared, shared_prefix_min_tokens=1, micro_batch_size=8),
                         model=dict(arch=arch, attn_implementation="sinkflex", seed=0, dtype=dtype, gradient_checkpointing=gc))
    learner = Learner(cfg, metrics=False)
    if weights is not None:  # the same weights in every dtype (random init differs per dtype)
        learner.model.load_state_dict(weights)
    rollouts, _, _ = learner.prepare(groups)
    idx = list(range(len(rollouts)))
    n_tokens = float(sum(int(r.mask_T.sum()) for r in rollouts))
    batches, stats = learner.micro_batches(rollouts, idx)
    logp, total = {}, 0.0
    for pb in batches:
        logp_RT, _ = rollout_logprobs(learner.logits(learner.model, pb), pb)
        loss, _ = grpo_loss(logp_RT, pb.old_logp_RT, pb.adv_RT, pb.mask_RT, num_tokens=n_tokens)
        loss.backward()
        total += loss.item()
        for i, r, _ in pb.segments:
            logp[i] = torch.where(rollouts[i].mask_T, logp_RT[r, : rollouts[i].num_positions].detach(), 0)
    grads = {k: p.grad.detach().double().clone() for k, p in learner.model.named_parameters()}
    return {i: v.double() for i, v in logp.items()}, total, grads, stats, learner.model.state_dict()


def _max_diff(a, b):
    lp = max((a[0][i] - b[0][i]).abs().max().item() for i in a[0])
    gr = max((a[2][k] - b[2][k]).abs().max().item() for k in a[2])
    return max(lp, abs(a[1] - b[1]), gr)


@pytest.mark.parametrize("arch", [TINY_LLAMA, GPT_OSS_F64], ids=["llama", "gpt_oss"])
def test_shared_equals_unshared(arch, float64_norms):
    groups = _groups()
    un32 = _loss_and_grads(arch, "float32", False, groups)
    w = un32[4]
    ref64 = _loss_and_grads(arch, "float64", False, groups, weights=w)
    sh64 = _loss_and_grads(arch, "float64", True, groups, gc=True, weights=w)
    assert sh64[3].shared_prefix_rows == 2 and ref64[3].shared_prefix_rows == 0
    assert _max_diff(ref64, sh64) <= 1e-10
    # float32: the shared error against float64 is within twice the unshared float32 error
    sh32 = _loss_and_grads(arch, "float32", True, groups, weights=w)
    e_un = _max_diff((un32[0], 0.0, un32[2]), (ref64[0], 0.0, ref64[2]))
    e_sh = _max_diff((sh32[0], 0.0, sh32[2]), (ref64[0], 0.0, ref64[2]))
    assert 0 < e_un < 1e-4 and e_sh <= 2 * e_un, (e_sh, e_un)
    assert abs(sh32[1] - ref64[1]) <= 2 * abs(un32[1] - ref64[1]) + 1e-7


def test_train_step_reports_sharing_and_falls_back(tmp_path, float64_norms):
    over = dict(model=dict(arch=TINY_LLAMA, attn_implementation="sinkflex", seed=0, dtype="float64"),
                optim=dict(lr=1e3, eps=1e3, max_grad_norm=None))
    out = []
    for shared in (False, True):
        learner = Learner(learner_config(tmp_path / str(shared), TINY_LLAMA, batch=dict(
            shared_prefix=shared, shared_prefix_min_tokens=1, micro_batch_size=8), **over), metrics=False)
        m = learner.train_step(_groups())
        out.append((m, {k: v.detach().clone() for k, v in learner.model.state_dict().items()}))
    (m_un, w_un), (m_sh, w_sh) = out
    assert m_sh["shared_prefix_rows"] == 2 and m_un["shared_prefix_rows"] == 0
    assert m_sh["positions_computed"] < m_un["positions_computed"] == m_un["positions_trained"] == m_sh["positions_trained"]
    assert abs(m_sh["loss"] - m_un["loss"]) <= 1e-10
    assert max((w_un[k] - w_sh[k]).abs().max().item() for k in w_un) <= 1e-9
    # a prefix shorter than the threshold: unshared rows, counted
    learner = Learner(learner_config(tmp_path / "fb", TINY_LLAMA, batch=dict(shared_prefix_min_tokens=64, micro_batch_size=8)),
                      metrics=False)
    m = learner.train_step(_groups())
    assert m["shared_prefix_rows"] == 0 and m["shared_prefix_fallback_groups"] == 2


def test_prefix_shared_across_groups_is_exact(tmp_path, float64_norms):
    """batch.shared_prefix_across_groups: two groups whose prompts start alike (a domain's system
    prompt) train as one row with their common prefix; the step equals unshared rows in float64."""
    groups = _groups()
    common = list(groups[0].trajectories[0].token_ids[:6])
    for t in groups[1].trajectories:  # group b's prompt: the same first 6 tokens, its own last 3
        ids = list(t.token_ids)
        ids[:6] = common
        del t.token_ids[:]
        t.token_ids.extend(ids)
    over = dict(model=dict(arch=TINY_LLAMA, attn_implementation="sinkflex", seed=0, dtype="float64"),
                optim=dict(lr=1e3, eps=1e3, max_grad_norm=None))
    out = []
    for name, batch in [("unshared", dict(shared_prefix=False)), ("per_group", dict(shared_prefix=True)),
                        ("across", dict(shared_prefix=True, shared_prefix_across_groups=True))]:
        learner = Learner(learner_config(tmp_path / name, TINY_LLAMA, batch=dict(
            shared_prefix_min_tokens=1, micro_batch_size=8, **batch), **over), metrics=False)
        m = learner.train_step(groups)
        out.append((m, {k: v.detach().clone() for k, v in learner.model.state_dict().items()}))
    (m_un, w_un), (m_pg, _), (m_ac, w_ac) = out
    assert m_pg["shared_prefix_rows"] == 2 and m_pg["shared_prefix_positions"] == 18
    assert m_ac["shared_prefix_rows"] == 1 and m_ac["shared_prefix_positions"] == 6
    assert m_ac["positions_computed"] < m_un["positions_computed"] == m_ac["positions_trained"]
    assert abs(m_ac["loss"] - m_un["loss"]) <= 1e-10
    assert max((w_un[k] - w_ac[k]).abs().max().item() for k in w_un) <= 1e-9


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 2e-6), (torch.bfloat16, 3e-2)])
def test_suffix_attention_low_precision_matches_float64(dtype, tol):
    """`_SuffixAttention` (prefix part and own causal part merged by their LSE, CPU) in float32
    and bfloat16 against the float64 masked SDPA: outputs and every gradient within the
    precision's rounding (GQA 4 query heads on 2 KV heads, suffixes of unequal length)."""
    import torch.nn.functional as F

    from sinkflex.attention.sdpa import _sdpa_suffixes_batched

    P, lengths = 37, [11, 4, 9]
    N = P + sum(lengths)
    sufs = [(P + sum(lengths[:i]), P + sum(lengths[: i + 1])) for i in range(len(lengths))]
    g = torch.Generator().manual_seed(3)
    base = [torch.randn(1, h, N, 16, dtype=torch.float64, generator=g) for h in (4, 2, 2)]
    w = torch.randn(1, 4, sum(lengths), 16, dtype=torch.float64, generator=g)

    def run(dt, fn):
        q, k, v = (x.to(dt, copy=True).requires_grad_() for x in base)
        out = fn(q, k, v)
        (out.double() * w).sum().backward()
        return [out.double(), q.grad.double(), k.grad.double(), v.grad.double()]

    def masked(q, k, v):  # the single masked call per suffix: the reference
        outs = []
        for a, e in sufs:
            ks, vs = (torch.cat([x[:, :, :P], x[:, :, a:e]], dim=2) for x in (k, v))
            cols = torch.arange(P + e - a)
            allowed = (cols[None, :] < P) | (cols[None, :] - P <= torch.arange(e - a)[:, None])
            outs.append(F.scaled_dot_product_attention(q[:, :, a:e], ks, vs, attn_mask=allowed, scale=0.25, enable_gqa=True))
        return torch.cat(outs, dim=2)

    ref = run(torch.float64, masked)
    got = run(dtype, lambda q, k, v: _sdpa_suffixes_batched(q, k, v, 0.25, P, sufs, max(lengths), True))
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, ref):
        err = ((a - b).abs().max() / b.abs().max().clamp_min(1e-6)).item()
        assert err <= tol, (name, err)
