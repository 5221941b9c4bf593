"""Adaptations that let speculators' `Trainer` run where this project runs it; nowhere else.

GPU: under torch 2.11's compile the fused loss's forward and backward Triton autotuners share one
configs list and the first step crashes ("ListVariable ... is already tracked for mutation");
giving the backward kernel its own list fixes it. speculators compiles the draft's whole forward, and
its decoder-layer frame gets a graph per KV-cache length and grad mode (14 for a 3-layer draft by the end
of its first validation); past dynamo's default limit of 8 it compiles no more (one warning, in the
draft's `train.log`) and runs inputs no compiled graph fits eagerly: that draft's second validation
took 44 s instead of about 3 s on an H200. The limit is raised to 64.

CPU: speculators 0.9.0 assumes an accelerator in three places:
`Trainer.setup_model`/`train_epoch` move the model and batches to `local_rank` (0, i.e. cuda:0);
its step timer calls `torch.accelerator.synchronize()`; and the checkpointer loads resume state onto
`get_current_device()`, which answers "cuda:0" when there is no accelerator. Attention and loss
need CPU-capable implementations too (flex attention has no CPU backward, the fused loss needs
Triton): see `draft_attn_impl` and `loss_implementation`. On CPU the trainer is given float32 as its
autocast dtype (`verifier.compute_dtype`), which CPU autocast declines with a warning per step site:
training then runs in plain float32, as intended, and the warning is silenced.

Everywhere: speculators saves epoch checkpoints (weights and optimizer state) in bf16, so a run
resumed from one continues from rounded weights and moments (and AdamW's step count, a float,
rounds past 256): its draft differed from an uninterrupted run's in every trial. Checkpoints are
saved in float32 instead, so resuming loads exactly the state training had; the scheduler state is
saved exactly already, the data order is a function of seed and epoch, and no training step draws
random numbers (no dropout), so no RNG state is needed. The draft artifact keeps speculators' bf16
weights (`save_bf16_checkpoint`, byte for byte what its checkpointer writes).
"""

from __future__ import annotations

import functools
import shutil
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import speculators.train.checkpointer as checkpointer_module
import speculators.train.trainer as trainer_module
import torch
from speculators.train.trainer import Trainer

__all__ = ["CpuTrainer", "ExactResumeTrainer", "draft_attn_impl", "loss_implementation", "save_bf16_checkpoint", "trainer_class"]


def draft_attn_impl(device: torch.device) -> str:
    return "simple_flex_attention" if device.type == "cuda" else "sdpa"


def loss_implementation(device: torch.device) -> str:
    return "fused" if device.type == "cuda" else "eager"


class _UnsyncedStepTimer(trainer_module._StepTimer):
    """The step timer minus its accelerator synchronisation (CPU work is already synchronous)."""

    def mark(self, name: str) -> None:
        if self.enabled:
            self._marks[name] = time.perf_counter()

    def now(self) -> float | None:
        return time.perf_counter() if self.enabled else None


class ExactResumeTrainer(Trainer):
    """speculators' Trainer with its checkpoints saved in float32, so a resumed run continues exactly."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)  # loads a checkpoint as the model's own dtype: float32 loads exactly
        self.checkpointer.save_checkpoint = functools.partial(  # type: ignore[method-assign]  # patched on this instance only
            self.checkpointer.save_checkpoint, float_dtype=torch.float32
        )


class CpuTrainer(ExactResumeTrainer):
    """speculators' Trainer with the model and batches on the CPU."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.device_type = "cpu"  # autocast device

    @property  # type: ignore[override]  # an int rank in Trainer, a device for `.to(local_rank)`: here the CPU
    def local_rank(self) -> str:
        return "cpu"

    @local_rank.setter
    def local_rank(self, _value: int) -> None:
        """Trainer.__init__ assigns the distributed local rank; on CPU the device is fixed."""


def _separate_fused_loss_autotune_configs() -> None:
    from speculators.losses import fused

    fused.loss_backward_kernel.configs = fused._tile_configs()


def _allow_a_graph_per_cache_length_and_grad_mode() -> None:
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)


@contextmanager
def trainer_class(device: torch.device) -> Iterator[type[Trainer]]:
    """The Trainer class to use on `device`, with speculators' accelerator assumptions lifted for CPU."""
    if device.type != "cpu":
        _separate_fused_loss_autotune_configs()
        _allow_a_graph_per_cache_length_and_grad_mode()
        yield ExactResumeTrainer
        return
    saved = trainer_module._StepTimer, checkpointer_module.get_current_device
    trainer_module._StepTimer = _UnsyncedStepTimer  # type: ignore[misc]  # patched for the CPU run, restored below
    checkpointer_module.get_current_device = lambda: "cpu"
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "In CPU autocast, but the target dtype is not supported")
            yield CpuTrainer
    finally:
        trainer_module._StepTimer, checkpointer_module.get_current_device = saved  # type: ignore[misc]  # the patch undone


def save_bf16_checkpoint(checkpoint: Path, out: Path) -> None:
    """Write the float32 epoch checkpoint `checkpoint` to `out` as speculators' checkpointer writes
    one: `model.safetensors` in bf16 (format metadata as `save_pretrained` gives it) and `config.json`
    with its dtype patched to match."""
    from safetensors.torch import load_file, save_file

    weights = checkpointer_module.convert_float_dtype(load_file(checkpoint / "model.safetensors"), torch.bfloat16)
    out.mkdir(parents=True, exist_ok=True)
    save_file(weights, out / "model.safetensors", metadata={"format": "pt"})
    shutil.copyfile(checkpoint / "config.json", out / "config.json")
    checkpointer_module.patch_config_dtype(out / "config.json", torch.bfloat16)
