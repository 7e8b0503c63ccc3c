"""Predicted GPU memory of the learner's GRPO step, without a GPU: the real step traced with
fake tensors, and an analytic count of the same parts beside it.

`trace_step` runs the project's own learner (`trainer.Learner`: `build_model`, `shard_model`
(FSDP2), `train_step`: the model on the chosen attention path, `picked_logprobs`' chunked
float32 log-probs, `grpo_loss`, backward, gradient clipping, AdamW) on fake tensors
(``FakeTensorMode``: shapes, dtypes and storages, no data) inside a fake process group of
``gpus`` ranks (``FakeStore``; this process is rank 0), under PyTorch's FSDP memory tracker
(``torch.distributed._tools.fsdp2_mem_tracker.FSDPMemTracker``), the way torchtitan's memory
estimation does. The tracker sees every allocation and free of the step and reports the peak;
this module splits that peak into parts by the tracker's categories (sharded / unsharded
parameters, gradients, optimizer state, FSDP all-gather / reduce-scatter buffers) and, for
activations and temporaries, by where they were allocated (inside an attention module, inside
``lm_head``, elsewhere in the model, or outside the model: the log-prob chunks, the loss).

What the trace departs from on a GPU, and why (docs/gpu_memory.md):
- The modelled device is the CPU with fake tensors: a CPU build of PyTorch cannot run
  autograd on fake CUDA tensors. The learner takes its CUDA choices anyway: bf16 weights
  (``model.dtype``), the flex sink path (`sinkflex.attention.hf.register(backend="flex")`), the
  CUDA default of AdamW (for-each: one temporary the size of the sharded parameters during
  the step), transformers' grouped-GEMM experts.
- Compiled FlexAttention cannot be compiled under fake tensors: `sinkflex.attention.flex.
  kernel_override` makes the sink path call the flex higher-order op directly; its fake
  implementation allocates what the fused kernel returns (out [B, Hq, N, D], LSE [B, Hq, N]
  float32) and its backward the gradients of q, k, v: nothing n×n, as on the GPU. The
  kernel's own workspace (row statistics of a few MB) is not counted.
- Values that steer the host code (token counts, masks, ids, the permutation of groups) are
  kept exactly: every tensor of at most `HOST_VALUE_LIMIT` elements also carries its real
  value, computed on the CPU beside the fake (`_HostValues`). Data-dependent questions about
  large tensors have no value; they are answered by assumption and counted in
  `Estimate.assumed`: a scalar read (the gradient norm, loss metrics) gives 1, and a
  ``nonzero`` (rows of the logits that receive a gradient) selects every element.
- DTensor derives output shapes by running ops on global-shape fakes under the active fake
  mode (in AdamW's step on FSDP2's sharded parameters); those never exist on a GPU and are
  left out of the count (`_PropagationUntracked`). An unsharded parameter's gradient counts as
  a gradient from the moment autograd writes it (the tracker would wait for FSDP's
  post-backward). The step runs after one untraced AdamW step on zero gradients, which
  allocates the moments a previous step leaves; its two micro-steps put the second one's
  backward beside every sharded gradient.
- The CUDA caching allocator's rounding and fragmentation are not modelled (the tracker counts
  tensor storages rounded to 512 bytes on CUDA, unrounded here); `torch.cuda.max_memory_allocated`
  counts the same storages, `max_memory_reserved` more.

Units: bytes everywhere; GB = 1e9 bytes in reports (the paper's unit).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import logging
import math
import time
from collections.abc import Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_leaves, tree_unflatten

from learner_service.config import LearnerConfig
from sinkflex.api.common.v1 import common_pb2

log = logging.getLogger(__name__)

GB = 1e9

#: Tensors of at most this many elements keep their real value beside the fake one.
HOST_VALUE_LIMIT = 1 << 20

#: openai/gpt-oss-20b's config.json (the architecture; no weights): 24 layers alternating
#: sliding-window (128) and full attention, 64 query / 8 KV heads of 64, learned sinks,
#: 32 experts top-4, vocabulary 201,088, yarn RoPE. 20.9 B parameters.
GPT_OSS_20B: dict = dict(
    model_type="gpt_oss",
    vocab_size=201088,
    hidden_size=2880,
    intermediate_size=2880,
    num_hidden_layers=24,
    num_attention_heads=64,
    num_key_value_heads=8,
    head_dim=64,
    num_local_experts=32,
    num_experts_per_tok=4,
    sliding_window=128,
    layer_types=["sliding_attention", "full_attention"] * 12,
    max_position_embeddings=131072,
    attention_bias=True,
    tie_word_embeddings=False,
    swiglu_limit=7.0,
    rope_parameters=dict(rope_type="yarn", factor=32.0, beta_fast=32.0, beta_slow=1.0, truncate=False,
                         original_max_position_embeddings=4096, rope_theta=150000.0),
)

#: Named architectures `arch_of` knows (the `sinkflex-rl memory --model` choices).
KNOWN_ARCHS = {"gpt-oss-20b": GPT_OSS_20B}

#: The parts of a peak, in report order.
PARTS = ("parameters", "gradients", "optimizer_state", "activations", "attention", "logits", "logprob_chunks", "fsdp_buffers", "other")


@dataclasses.dataclass(frozen=True)
class Estimate:
    """One rank's predicted peak memory of a GRPO step.

    peak_bytes: the largest total of live tensor storages during the traced steps.
    parts: {part: bytes} at that moment (`PARTS`; they add up to peak_bytes).
    categories: the tracker's own categories at that moment ({"Sharded Param": bytes, ...}).
    phase: where the peak fell: "forward" (the model's), "log-probs" (after it, until the logits'
        gradient: log-probs, loss, their backward), "backward" (the model's), "optimizer" or "outside".
    assumed: {op: count} of data-dependent reads answered by assumption (module docstring).
    seconds: wall time of the trace.
    phase_peaks: {phase: the largest total within it} (e.g. the forward/backward's peak beside
        the optimizer step's).
    """

    peak_bytes: int
    parts: dict[str, int]
    categories: dict[str, int]
    phase: str
    assumed: dict[str, int]
    seconds: float
    phase_peaks: dict[str, int] = dataclasses.field(default_factory=dict)


# ------------------------------------------------------------------ host values beside fakes


class _HostValues(TorchDispatchMode):
    """Runs under a `FakeTensorMode`: every real tensor an op meets becomes a fake one, and every
    tensor of at most `limit` elements whose inputs all have values gets its real value too
    (computed on the CPU with the fake mode off). Data-dependent ops (``.item()``, ``nonzero``,
    boolean indexing) use those values; without one they are answered by assumption (a scalar
    read gives 1 / True, ``nonzero`` selects everything) and counted in `assumed`."""

    supports_higher_order_operators = True  # flex attention's op passes through

    def __init__(self, fake_mode, limit: int = HOST_VALUE_LIMIT):
        super().__init__()
        self.fake_mode = fake_mode
        self.limit = limit
        self.assumed: collections.Counter[str] = collections.Counter()

    def _fake(self, t: torch.Tensor) -> torch.Tensor:
        from torch._subclasses.fake_tensor import FakeTensor

        if isinstance(t, FakeTensor):
            return t
        f = self.fake_mode.from_tensor(t)
        f._host_value = t
        return f

    @staticmethod
    def _value(t: torch.Tensor) -> torch.Tensor | None:
        # an attribute, not a weak-keyed table: modules swap fake parameters (`Module._apply`),
        # which a weak reference to them would forbid
        return getattr(t, "_host_value", None)

    def _real_call(self, func, flat, spec):
        from torch._subclasses.fake_tensor import unset_fake_temporarily

        real = [self._value(a) if isinstance(a, torch.Tensor) else a for a in flat]
        args, kwargs = tree_unflatten(real, spec)
        with unset_fake_temporarily():
            return func(*args, **kwargs)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch._subclasses.fake_tensor import (
            DataDependentOutputException,
            DynamicOutputShapeException,
        )

        flat, spec = tree_flatten((args, kwargs or {}))
        flat = [self._fake(a) if isinstance(a, torch.Tensor) else a for a in flat]
        known = all(self._value(a) is not None for a in flat if isinstance(a, torch.Tensor))
        fargs, fkwargs = tree_unflatten(flat, spec)
        try:
            out = func(*fargs, **fkwargs)
        except (DataDependentOutputException, DynamicOutputShapeException):
            if known:
                return tuple_map(self._fake, self._real_call(func, flat, spec))
            return self._assume(func, fargs, fkwargs)
        tensors = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        if not isinstance(func, torch._ops.OpOverload):  # a higher-order op (flex attention): no values
            for t in tensors:
                t.__dict__.pop("_host_value", None)
            return out
        if known and func.namespace == "aten" and func.overloadpacket not in _NO_VALUE and all(t.numel() <= self.limit for t in tensors):
            try:
                real_out = self._real_call(func, flat, spec)
            except Exception:  # noqa: BLE001 - a value we cannot compute is a value we do not keep
                real_out = None
            if real_out is not None:
                for f, r in zip(tree_leaves(out), tree_leaves(real_out)):
                    if isinstance(f, torch.Tensor) and isinstance(r, torch.Tensor):
                        f._host_value = r
                return out
        for i, arg in enumerate(func._schema.arguments):  # a write of unknown values: forget the old one
            if arg.alias_info is not None and arg.alias_info.is_write and i < len(fargs) and isinstance(fargs[i], torch.Tensor):
                fargs[i].__dict__.pop("_host_value", None)
        for t in tensors:
            t.__dict__.pop("_host_value", None)
        return out

    def _assume(self, func, args, kwargs):
        aten = torch.ops.aten
        name = str(func.overloadpacket.__name__)
        self.assumed[name] += 1
        if func is aten._local_scalar_dense.default:
            t = args[0]
            return True if t.dtype == torch.bool else (1 if not t.is_floating_point() else 1.0)
        if func is aten.nonzero.default:
            return _all_indices(args[0]).t().contiguous() if args[0].dim() else torch.zeros(1, 0, dtype=torch.long)
        if func is aten.index.Tensor:
            x, indices = args
            return func(x, _expand_bool_indices(indices))
        raise NotImplementedError(f"memory model: data-dependent op {func} on a tensor without a value")


#: Ops whose outputs have no meaningful value (uninitialised memory); collectives (other
#: namespaces) have none either: the fake process group moves no data.
_NO_VALUE = {torch.ops.aten.empty, torch.ops.aten.empty_like, torch.ops.aten.empty_strided, torch.ops.aten.new_empty,
             torch.ops.aten.new_empty_strided}


def tuple_map(fn, out):
    """`fn` on every tensor of a (possibly nested) op output; scalars as they are."""
    flat, spec = tree_flatten(out)
    return tree_unflatten([fn(x) if isinstance(x, torch.Tensor) else x for x in flat], spec)


def _all_indices(mask: torch.Tensor) -> torch.Tensor:
    """[ndim, numel] int64 indices of every element of `mask` (an all-true nonzero)."""
    flat = torch.arange(mask.numel(), device=mask.device)
    return torch.stack(torch.unravel_index(flat, mask.shape)) if mask.dim() else flat[None]


def _expand_bool_indices(indices):
    out = []
    for ix in indices:
        if ix is not None and ix.dtype == torch.bool:
            out.extend(_all_indices(ix).unbind(0))
        else:
            out.append(ix)
    return out


# ------------------------------------------------------------------ the tracker, with parts


def _parts_tracker(model, optimizer):
    """An `FSDPMemTracker` that also keeps, for the peak moment, every live byte's part."""
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker, _FSDPRefType
    from torch.distributed._tools.mem_tracker import _UpdateType

    by_category = {
        _FSDPRefType.SHARDED_PARAM: "parameters", _FSDPRefType.UNSHARDED_PARAM: "parameters",
        _FSDPRefType.BUFFER: "parameters", _FSDPRefType.SHARDED_GRAD: "gradients",
        _FSDPRefType.UNSHARDED_GRAD: "gradients", _FSDPRefType.OPT: "optimizer_state",
        _FSDPRefType.ALL_GATHER: "fsdp_buffers", _FSDPRefType.REDUCE_SCATTER: "fsdp_buffers",
        _FSDPRefType.INP: "other",
    }

    class PartsTracker(FSDPMemTracker):
        supports_higher_order_operators = True  # flex attention's op: its outputs are tracked like any op's

        def __init__(self):
            super().__init__(model, optimizer)
            self.live: collections.Counter = collections.Counter()  # (category, region) -> bytes
            self.total = 0
            self.peak = 0
            self.peak_live: dict = {}
            self.peak_phase = "outside"
            self.phase = "outside"
            self.hooked: set[int] = set()
            self.phase_peaks: dict[str, int] = {}

        paused = 0  # > 0: inside DTensor's sharding propagation (`_PropagationUntracked`)

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if self.paused:
                return func(*args, **(kwargs or {}))
            return super().__torch_dispatch__(func, types, args, kwargs)

        def _fsdp_state_pre_forward(self, fsdp_mod, orig_fsdp_state_pre_fw):
            inner = super()._fsdp_state_pre_forward(fsdp_mod, orig_fsdp_state_pre_fw)

            def each_micro_step(*args, **kwargs):  # one forward per micro-step: module stats per call
                if fsdp_mod is self._root_mod and fsdp_mod in self.memory_tracking and not self._mod_tracker.is_bw:
                    self.reset_mod_stats()
                out = inner(*args, **kwargs)
                self._hook_unsharded_grads(fsdp_mod)
                return out

            return each_micro_step

        def _hook_unsharded_grads(self, fsdp_mod) -> None:
            """An unsharded parameter's gradient counts as a gradient from the moment autograd
            writes it (the tracker would call it a temporary until FSDP's post-backward, which
            for the root unit, lm_head included, is the end of the whole backward)."""
            group = fsdp_mod._get_fsdp_state()._fsdp_param_group
            for fsdp_param in group.fsdp_params if group is not None else ():
                param = fsdp_param.unsharded_param
                if id(param) not in self.hooked:
                    self.hooked.add(id(param))
                    param.register_post_accumulate_grad_hook(self._mark_grad)

        def _mark_grad(self, param) -> None:
            if param.grad is not None:
                self._update_and_maybe_create_winfos(param.grad, _FSDPRefType.UNSHARDED_GRAD)

        def region(self) -> str:
            parents = self._mod_tracker.parents
            if any(".self_attn" in p for p in parents):
                return "attention"
            if any(p.endswith("lm_head") for p in parents):
                return "logits"
            if len(parents) > 1:
                return "activations"
            return "other" if self.phase in ("optimizer", "outside") else "logprob_chunks"

        def _update_snap(self, u_type, winfo, old_mem_consumed=None, old_reftype=None):
            super()._update_snap(u_type, winfo, old_mem_consumed, old_reftype)
            if not hasattr(winfo, "region"):
                winfo.region = self.region()
            mem = winfo.mem_consumed
            if u_type == _UpdateType.ADD:
                self.live[(winfo.reftype, winfo.region)] += mem
                self.total += mem
            elif u_type == _UpdateType.DEL:
                self.live[(winfo.reftype, winfo.region)] -= mem
                self.total -= mem
            elif u_type == _UpdateType.REF:
                self.live[(old_reftype, winfo.region)] -= mem
                self.live[(winfo.reftype, winfo.region)] += mem
            elif u_type == _UpdateType.SIZE:
                self.live[(winfo.reftype, winfo.region)] += mem - old_mem_consumed
                self.total += mem - old_mem_consumed
            if self.total > self.phase_peaks.get(self.phase, 0):
                self.phase_peaks[self.phase] = self.total
            if self.total > self.peak:
                self.peak = self.total
                self.peak_live = {k: v for k, v in self.live.items() if v}
                self.peak_phase = self.phase

        def parts(self) -> tuple[dict[str, int], dict[str, int]]:
            parts = dict.fromkeys(PARTS, 0)
            cats: collections.Counter = collections.Counter()
            for (cat, region), b in self.peak_live.items():
                cats[cat.value] += b
                parts[by_category.get(cat, region)] += b
            return parts, dict(cats)

    return PartsTracker()


class _PropagationUntracked:
    """Installed as DTensor's ``ShardingPropagator._fake_mode_lock`` (a nullcontext by default,
    entered around each sharding propagation): DTensor derives output shapes by running the op
    on global-shape fake tensors under the active fake mode, which inside a fake trace is ours,
    so the tracker would count those never-allocated global tensors (in AdamW's step on
    FSDP2's sharded parameters: several times the full parameters). Pauses the tracker there."""

    def __init__(self, tracker):
        self.tracker = tracker

    def __enter__(self):
        self.tracker.paused += 1

    def __exit__(self, *exc):
        self.tracker.paused -= 1


@contextlib.contextmanager
def _untracked_propagation(tracker) -> Iterator[None]:
    from torch.distributed.tensor._sharding_prop import ShardingPropagator

    old = ShardingPropagator._fake_mode_lock
    ShardingPropagator._fake_mode_lock = _PropagationUntracked(tracker)
    try:
        yield
    finally:
        ShardingPropagator._fake_mode_lock = old


# ------------------------------------------------------------------ the traced step


def synthetic_group(group_id: str, rollouts: int, seq_len: int, prompt_len: int, vocab: int, seed: int) -> common_pb2.TrajectoryGroup:
    """A TrajectoryGroup of `rollouts` trajectories of `seq_len` tokens each: a shared random
    prompt of `prompt_len` tokens (loss mask 0), then generated tokens (loss mask 1, engine
    log-prob −log V); rewards alternate 1, 0 so that every advantage is ±1 (none skipped)."""
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, vocab, (prompt_len,), generator=g).tolist()
    group = common_pb2.TrajectoryGroup(group_id=group_id, task_id=f"plan-{seed}", env="plan")
    lp = -math.log(vocab)
    for i in range(rollouts):
        ids = prompt + torch.randint(0, vocab, (seq_len - prompt_len,), generator=g).tolist()
        mask = [0] * prompt_len + [1] * (seq_len - prompt_len)
        group.trajectories.add(trajectory_id=f"{group_id}-{i}", task_id=group.task_id, env="plan", token_ids=ids,
                               logprobs=[lp if m else 0.0 for m in mask], loss_mask=mask, reward=float(i % 2 == 0))
    return group


@contextlib.contextmanager
def fake_world(gpus: int, real: bool = False) -> Iterator[None]:
    """A fake process group of `gpus` ranks (this process is rank 0): collectives return at once
    and move no data. real: a one-rank gloo group instead (real values: a real run's step)."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("memory model: a process group is already initialised in this process")
    if real:
        if gpus != 1:
            raise ValueError(f"a real (unfaked) trace runs one rank, got gpus={gpus}")
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    else:
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=gpus)
    try:
        yield
    finally:
        dist.destroy_process_group()


@contextlib.contextmanager
def _cuda_choices(attention: str) -> Iterator:
    """The learner's CUDA code paths on the CPU: the flex sink path through the flex op (no
    compile). Yields a function to call once the model is built (building it registers the
    sinkflex attention again, with its default backend), which makes flex the backend until
    the block ends."""
    from torch.nn.attention import flex_attention as fa

    from sinkflex.attention import hf
    from sinkflex.attention.flex import kernel_override

    def uncompiled_flex(*args, **kwargs):
        # the op itself, not torch.compile of it; its CPU-backward refusal is about the dense CPU
        # kernel, which fake tensors never run
        old = fa._FLEX_ATTENTION_DISABLE_COMPILE_DEBUG, fa._validate_device
        fa._FLEX_ATTENTION_DISABLE_COMPILE_DEBUG, fa._validate_device = True, lambda *a, **k: None
        try:
            return fa.flex_attention(*args, **kwargs)
        finally:
            fa._FLEX_ATTENTION_DISABLE_COMPILE_DEBUG, fa._validate_device = old

    old_backend = hf._BACKEND["name"]
    try:
        with kernel_override(uncompiled_flex):
            yield lambda: hf.register(hf.NAME, backend="flex" if attention == "sinkflex" else old_backend)
    finally:
        hf.register(hf.NAME, backend=old_backend)


def learner_config(arch: dict, seq_len: int, attention: str, gradient_checkpointing: bool = True,
                   base: LearnerConfig | None = None) -> LearnerConfig:
    """`base` (default: the defaults) with the model, attention, bf16, micro-batch 1 and
    max_seq_len = seq_len that a memory plan traces."""
    data = base.model_dump() if base is not None else {}
    data["model"] = {**data.get("model", {}), "path": None, "arch": dict(arch), "attn_implementation": attention,
                     "dtype": "bfloat16", "gradient_checkpointing": gradient_checkpointing}
    data["batch"] = {**data.get("batch", {}), "micro_batch_size": 1, "max_seq_len": seq_len}
    data["tensorboard"] = False
    return LearnerConfig.model_validate(data)


def trace_step(cfg: LearnerConfig, seq_len: int, gpus: int, steps: int = 1, fake: bool = True,
               foreach: bool = True) -> Estimate:
    """Traces `steps` learner steps (each: 2 rollouts of `seq_len` tokens per rank, one per
    micro-step, so that the second micro-step runs with every sharded gradient allocated) on
    rank 0 of `gpus` ranks, after one AdamW step on zero gradients (untraced: the optimizer
    state a previous step leaves), and returns the peak.

    Args:
        cfg: the learner config (its model.arch is built with random weights; model.path is not read).
        seq_len: tokens per rollout (≤ cfg.batch.max_seq_len, or that is None).
        gpus: learner ranks (FSDP2 shards over them).
        steps: learner steps traced.
        fake: False runs the same step with real tensors on the CPU paths (small configs, one
            rank over gloo: the check of the fake trace against a real run), under the same tracker.
        foreach: AdamW's for-each implementation (its default on CUDA; on CPU tensors it would
            default to the per-tensor loop).

    Returns:
        the `Estimate`.

    Raises:
        ValueError: seq_len < 2 or gpus < 1.
    """
    from torch._subclasses.fake_tensor import FakeTensorMode

    from learner_service.trainer import Learner

    if seq_len < 2 or gpus < 1:
        raise ValueError(f"need seq_len >= 2 and gpus >= 1, got seq_len={seq_len}, gpus={gpus}")
    arch = cfg.model.arch or {}
    vocab = int(arch.get("vocab_size", 1000))
    t0 = time.perf_counter()
    groups = [synthetic_group(f"plan-{s}", 2 * gpus, seq_len, min(64, seq_len // 4) or 1, vocab, seed=s) for s in range(steps)]
    fake_mode = FakeTensorMode(allow_non_fake_inputs=True) if fake else None
    values = _HostValues(fake_mode) if fake else None
    with contextlib.ExitStack() as stack:
        stack.enter_context(fake_world(gpus, real=not fake))
        if fake:
            choose_flex = stack.enter_context(_cuda_choices(cfg.model.attn_implementation))
            stack.enter_context(fake_mode)
            stack.enter_context(values)
        learner = Learner(cfg, device=torch.device("cpu"), metrics=False)
        if fake:
            choose_flex()
        if foreach:
            for group in learner.optimizer.param_groups:
                group["foreach"] = True
        _warm_optimizer(learner.optimizer)
        tracker = _parts_tracker(learner.model, learner.optimizer)
        _phases(learner, tracker)
        with _untracked_propagation(tracker), tracker:
            for g in groups:
                learner.train_step([g])
        parts, cats = tracker.parts()
        peak = tracker.peak
        phase = tracker.peak_phase
        phase_peaks = dict(tracker.phase_peaks)
        del learner
    assumed = dict(values.assumed) if values is not None else {}
    return Estimate(peak, parts, cats, phase, assumed, time.perf_counter() - t0, phase_peaks)


def _warm_optimizer(optimizer: torch.optim.Optimizer) -> None:
    """One AdamW step on zero gradients: allocates the moments a previous learner step leaves
    (the same tensors, without tracing a whole step for them); the weights do not change."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    for p in params:
        p.grad = torch.zeros_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _phases(learner, tracker) -> None:
    """Marks the tracker's phase: forward (the model's forward), log-probs (from its end until the
    logits' gradient exists), backward (from then), optimizer (AdamW's step), outside otherwise."""
    model = learner.model

    def pre_forward(*_):
        tracker.phase = "forward"

    def post_forward(_m, _a, out):
        tracker.phase = "log-probs"
        logits = getattr(out, "logits", None)
        if isinstance(logits, torch.Tensor) and logits.requires_grad:
            logits.register_hook(_backward)

    def _backward(grad):
        tracker.phase = "backward"

    def pre_step(*_):
        tracker.phase = "optimizer"

    def post_step(*_):
        tracker.phase = "outside"

    model.register_forward_pre_hook(pre_forward)
    model.register_forward_hook(post_forward)
    learner.optimizer.register_step_pre_hook(pre_step)
    learner.optimizer.register_step_post_hook(post_step)


# ------------------------------------------------------------------ the analytic count


def param_counts(arch: dict, gpus: int = 1) -> tuple[int, list[int], int, list[int]]:
    """(parameters of the root FSDP unit: embeddings, final norm, lm_head; [parameters of each
    decoder layer]; the root's and [each layer's] per-rank shard sizes over `gpus` ranks, FSDP2's
    way: every parameter split along dim 0, padded to a multiple of `gpus`), counted on a model
    built on the meta device (no memory)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    a = dict(arch)
    hf_config = AutoConfig.for_model(a.pop("model_type"), **a)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config)

    def shard(params) -> int:
        return sum(-(-p.shape[0] // gpus) * (p.numel() // p.shape[0]) if p.dim() else 1 for p in params)

    layer_ids = {id(p) for layer in model.model.layers for p in layer.parameters()}
    root_params = [p for p in model.parameters() if id(p) not in layer_ids]
    layers = [sum(p.numel() for p in layer.parameters()) for layer in model.model.layers]
    layer_shards = [shard(layer.parameters()) for layer in model.model.layers]
    return sum(p.numel() for p in root_params), layers, shard(root_params), layer_shards


def analytic_peak(arch: dict, seq_len: int, gpus: int, attention: str, gradient_checkpointing: bool = True,
                  chunk: int = 1024) -> tuple[int, dict[str, int], str]:
    """The same step's peak by counting tensors: (peak bytes, {part: bytes}, phase) for one rank.

    bf16 weights, gradients and AdamW moments sharded over `gpus` (2 bytes each per parameter
    / gpus, with FSDP2's padding of dim 0 to a multiple of gpus); the root unit (embeddings,
    lm_head) unsharded through forward and backward (FSDP2 keeps the root's parameters after
    forward) and lm_head's gradient unsharded until the root's post-backward; in a layer's
    backward its unsharded parameters and gradients and two all-gather outputs (its own and the
    prefetched layer's); one micro-step of one sequence of N = seq_len tokens. Three candidate
    moments, the largest is the peak:
    - "optimizer": the state plus AdamW's for-each temporary (√v, one sharded copy);
    - "logits": backward entering lm_head: logits [N, V] bf16 (kept by the log-prob op), their
      gradient [N, V], two float32 chunks [chunk, V], lm_head's weight gradient unsharded, the
      checkpointed layer inputs;
    - "layer": backward of one decoder layer: its recomputed activations (attention and MoE,
      below), the gradients flowing back (about the size of its largest saved tensor), its
      unsharded weight gradients, the checkpoints.
    Attention of one layer: sinkflex keeps q, k, v (before and after RoPE), the flex output,
    the LSE (float32), the float32 output and σ(lse − sink) of the rescale and its bf16 copy;
    eager keeps the repeated K/V and the softmax [Hq, N, N + 1] (bf16; the scores' scaled,
    masked, sink-concatenated and shifted copies are transient) and its backward adds two more
    of that size (the gradient of the probabilities and of the softmax input), plus the
    additive masks [N, N] of both layer types for the whole step.
    Departures: FSDP's padding of sharded dims, the allocator's rounding and the kernels' own
    workspaces are not counted.
    """
    root, layers, root_shard, layer_shards = param_counts(arch, gpus)
    n, b = seq_len, 2
    h = int(arch["hidden_size"])
    v = int(arch["vocab_size"])
    hq, hkv = int(arch["num_attention_heads"]), int(arch["num_key_value_heads"])
    d = int(arch.get("head_dim") or h // hq)
    k = int(arch.get("num_experts_per_tok", 1))
    inter = int(arch["intermediate_size"])
    s = n * k  # token-expert pairs
    shard = b * (root_shard + sum(layer_shards))  # bf16 shards, FSDP2's dim-0 padding included
    layer_full, layer_padded = b * max(layers), b * gpus * max(layer_shards)
    head_grad = b * v * h if not arch.get("tie_word_embeddings") else 0  # lm_head's unsharded gradient, kept to the root's post-backward
    static = {"parameters": shard + b * root, "gradients": shard, "optimizer_state": 2 * shard}
    checkpoints = b * n * h * (len(layers) + 1) if gradient_checkpointing else 0
    flow = 2 * b * n * h  # the gradient flowing back through the residual stream, and its sum
    # one decoder layer in backward (recomputed): the MoE's backward runs first with everything
    # of the layer saved, the attention's backward after it with the MoE's tensors freed
    norms = 2 * (4 * n * h + b * n * h)  # two RMSNorms: float32 copy, bf16 output
    qkv = b * n * d * (hq + 2 * hkv)
    if attention == "eager":
        scores = b * hq * n * (n + 1)
        attn_saved = 2 * qkv + 2 * b * n * hq * d + scores + 2 * b * n * hq * d  # rope, repeat_kv, softmax (its [..., :-1] a view), out
        attn_grad = 2 * scores  # ∂probs and the softmax backward's output
        masks = 2 * b * n * n  # additive masks of both layer types, kept for the step
    else:
        attn_saved = 2 * qkv + 2 * b * n * hq * d + 8 * hq * n + 4 * n * hq * d  # rope, out + contiguous, lse, σ, fp32 out
        attn_grad = 4 * n * hq * d + b * n * hq * d + qkv  # ∂(fp32 out), ∂out, dq/dk/dv
        masks = 0
    moe_saved = 4 * b * s * h + 9 * b * s * inter + 16 * s  # [S,H] gathered/out; [S,2I] proj; gate math [S,I]; ids
    moe_grad = b * s * h + 2 * b * s * inter
    moe_moment = norms + attn_saved + moe_saved + moe_grad
    attn_moment = norms // 2 + attn_saved + attn_grad
    layer_attention = attn_saved + (attn_grad if attn_moment >= moe_moment else 0) + masks
    layer = {**static, "parameters": static["parameters"] + layer_full, "gradients": shard + head_grad + layer_full,
             "activations": checkpoints + flow + max(attn_moment, moe_moment) - attn_saved - (attn_grad if attn_moment >= moe_moment else 0),
             "attention": layer_attention, "fsdp_buffers": 2 * layer_padded}
    logits = {**static, "gradients": shard + head_grad, "activations": checkpoints, "attention": masks,
              "logits": 2 * b * n * v + 2 * 4 * min(chunk, n) * v, "fsdp_buffers": layer_padded}
    optimizer = {**static, "optimizer_state": 3 * shard, "parameters": shard}
    phases = {"layer": layer, "logits": logits, "optimizer": optimizer}
    phase = max(phases, key=lambda p: sum(phases[p].values()))
    parts = dict.fromkeys(PARTS, 0)
    parts.update(phases[phase])
    return sum(parts.values()), parts, phase


def plan_row(config: str, cfg: LearnerConfig, seq_len: int, gpus: int, trace: bool = True) -> dict:
    """One row of the memory table: the traced peak (`trace_step`; none when trace=False) and the
    analytic count (`analytic_peak`) of cfg's model at seq_len tokens on `gpus` ranks, in GB
    (1e9 bytes). `config` names the row."""
    arch = cfg.model.arch or {}
    attention = cfg.model.attn_implementation
    a_peak, a_parts, a_phase = analytic_peak(arch, seq_len, gpus, attention, cfg.model.gradient_checkpointing)
    row = {"config": config, "seq_len": seq_len, "attention": attention, "gpus": gpus,
           "gradient_checkpointing": cfg.model.gradient_checkpointing,
           "analytic_peak_gb": round(a_peak / GB, 3), "analytic_phase": a_phase,
           "analytic_parts": {k: round(v / GB, 3) for k, v in a_parts.items() if v}}
    if trace:
        est = trace_step(cfg, seq_len, gpus)
        row.update(predicted_peak_gb=round(est.peak_bytes / GB, 3), phase=est.phase,
                   parts={k: round(v / GB, 3) for k, v in est.parts.items() if v},
                   tracker_categories={k: round(v / GB, 3) for k, v in est.categories.items() if v},
                   phase_peaks_gb={k: round(v / GB, 3) for k, v in est.phase_peaks.items()},
                   analytic_vs_traced=round(a_peak / est.peak_bytes - 1, 4), assumed=est.assumed,
                   trace_seconds=round(est.seconds, 1))
    return row
