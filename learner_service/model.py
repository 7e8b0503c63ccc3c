"""Building the policy (and reference) model: transformers causal LM on the sink path, FSDP2.

- The attention implementation "sinkflex" is the project's sink-aware path
  (`sinkflex.attention`, registered with transformers' AttentionInterface on import);
  any built-in name ("eager", "sdpa") works too.
- `build_model` loads a folder (`model.path`) or randomly initialises a config
  (`model.arch`) with a fixed seed, so every rank starts from identical weights.
- `shard_model` applies FSDP2 (`torch.distributed.fsdp.fully_shard`) per decoder layer and
  then to the root, when a process group is initialised (torchrun); otherwise the model
  stays a plain module (single process, in-process tests).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import nn

from learner_service.config import ModelConfig
from sinkflex.hardware import bf16_verdict, cpu_has_fast_bf16  # noqa: F401 - re-exported

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Precision:
    """What `dtype` resolved to: parameter dtype and an optional autocast compute dtype."""

    params: torch.dtype  # the weights (and AdamW's master copy)
    autocast: torch.dtype | None  # bf16 autocast over fp32 weights (CPU with fast bf16), or None
    reason: str

    def describe(self) -> str:
        p = str(self.params).removeprefix("torch.")
        c = f", {str(self.autocast).removeprefix('torch.')} autocast" if self.autocast is not None else ""
        return f"{p} weights{c} ({self.reason})"


def resolve_precision(cfg: ModelConfig, device: torch.device) -> Precision:
    """dtype auto → CUDA: bf16 weights; CPU with fast bf16 (measured, `sinkflex.hardware.bf16_verdict`):
    fp32 weights + bf16 autocast; else fp32.

    Autocast (not bf16 weights) on CPU: AdamW keeps updating the fp32 weights (no separate
    master copy to manage), checkpoints and published policies stay fp32, and the bare-loop
    measurement (docs/bench_learner.md) put autocast within ~10 % of bf16 weights.
    """
    if cfg.dtype != "auto":
        return Precision(getattr(torch, cfg.dtype), None, f"model.dtype {cfg.dtype}")
    if device.type == "cuda":
        return Precision(torch.bfloat16, None, "auto on CUDA")
    fast, why = bf16_verdict()
    if fast:
        return Precision(torch.float32, torch.bfloat16, f"auto: fast bf16 on this CPU: {why}")
    return Precision(torch.float32, None, f"auto: no fast bf16 on this CPU: {why}")


def resolve_dtype(cfg: ModelConfig, device: torch.device) -> torch.dtype:
    """The parameter dtype (`resolve_precision`): auto → bfloat16 on CUDA, float32 on CPU."""
    return resolve_precision(cfg, device).params


def ensure_attention(name: str) -> str:
    """Makes sure attention implementation `name` is registered with transformers.

    Raises:
        ValueError: "sinkflex" requested but `sinkflex.attention` is not importable.
    """
    if name == "sinkflex":
        try:
            import sinkflex.attention as sa
        except ImportError as err:  # the attention package is missing: say so, never fall back
            raise ValueError(f"attn_implementation 'sinkflex' needs sinkflex.attention: {err}") from err
        register = getattr(sa, "register", None)
        if callable(register):
            register()
    return name


def build_model(cfg: ModelConfig, device: torch.device) -> nn.Module:
    """A transformers causal LM in training mode on `device`, use_cache off.

    Args:
        cfg: the model section of the config.
        device: where the parameters live before sharding.

    Returns:
        the model (e.g. GptOssForCausalLM, LlamaForCausalLM), parameters in `resolve_dtype`.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    dtype = resolve_dtype(cfg, device)
    attn = ensure_attention(cfg.attn_implementation)
    if cfg.path is not None:
        model = AutoModelForCausalLM.from_pretrained(cfg.path, attn_implementation=attn, dtype=dtype)
    else:
        arch = dict(cfg.arch or {})
        hf_config = AutoConfig.for_model(arch.pop("model_type"), **arch)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(cfg.seed)
            model = AutoModelForCausalLM.from_config(hf_config, attn_implementation=attn, dtype=dtype)
    model.config.use_cache = False
    if any(t.device != device for t in (*model.parameters(), *model.buffers())):
        model.to(device)  # (a no-op move is skipped: fake parameters cannot be swapped in place)
    model.train()
    if cfg.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The repeated transformer blocks (model.model.layers for transformers' decoder LMs)."""
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if layers is None:
        raise ValueError(f"{type(model).__name__}: no model.layers to shard")
    return list(layers)


def shard_model(model: nn.Module, reshard_after_forward: bool = True) -> nn.Module:
    """FSDP2: fully_shard each decoder layer, then the root (no-op without a process group).

    Gradients are reduce-scattered as sums (divide factor 1): the loss is already divided
    by the global token count, so a sum over ranks is the exact global gradient.
    """
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return model
    from torch.distributed.fsdp import FSDPModule, fully_shard

    for layer in decoder_layers(model):
        fully_shard(layer, reshard_after_forward=reshard_after_forward)
    fully_shard(model, reshard_after_forward=reshard_after_forward)
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_gradient_divide_factor(1.0)
            m.set_force_sum_reduction_for_comms(True)  # plain SUM (gloo has no PREMUL_SUM)
    return model


def freeze(model: nn.Module) -> nn.Module:
    """A reference model: no gradients, eval mode."""
    model.requires_grad_(False)
    model.eval()
    return model
