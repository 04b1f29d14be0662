"""The optimisation side of a run: each micro-batch's loss forward and backward (gradients accumulated across an
optimizer step's micro-batches, all-reduced on its last), the clipped optimizer and scheduler step, and the
reference model that ``sync_ref_model`` moves towards the policy."""

from __future__ import annotations

from typing import Any

import torch

from . import algorithms as alg
from .batching.batch import ModelBatch
from .config import RunConfig, TrainSettings
from .forward_passes import ForwardPasses
from .generation_batch import GenerationBatch
from .sharding import full_grad_norm, is_sharded
from .step_metrics import to_float
from .training_error import TrainingError


def loss_settings(t: TrainSettings, world: int) -> alg.GRPOLossSettings:
    """The GRPO loss's settings for this run (``world``: the number of processes)."""
    return alg.GRPOLossSettings(
        loss_type=t.loss_type,
        epsilon_low=t.epsilon_low,
        epsilon_high=t.epsilon_high_value,
        delta=t.delta,
        beta=t.beta,
        use_bias_correction_kl=t.use_bias_correction_kl,
        importance_sampling_level=t.importance_sampling_level,
        sapo_temperature_pos=t.sapo_temperature_pos,
        sapo_temperature_neg=t.sapo_temperature_neg,
        vespo_k_pos=t.vespo_k_pos,
        vespo_lambda_pos=t.vespo_lambda_pos,
        vespo_k_neg=t.vespo_k_neg,
        vespo_lambda_neg=t.vespo_lambda_neg,
        entropy_coef=t.entropy_coef,
        max_completion_length=t.max_completion_length,
        gradient_accumulation_steps=t.gradient_accumulation_steps,
        steps_per_generation=t.generation_steps,
        num_processes=world,
    )


def loss_metrics(
    out: alg.LossOutput, entropy: torch.Tensor, mask: torch.Tensor, entropy_coef: float = 0.0
) -> dict[str, float]:
    """A micro-batch's loss-side metrics under TRL's names: ``loss``, ``entropy``, the ``kl`` term as TRL logs it,
    ``clip_ratio/*`` for the clipped losses, ``cispo_clip_ratio``, ``vespo/phi_seq_mean``, and with the entropy
    bonus ``policy_loss`` and ``entropy_coef``."""
    fmask = mask.float()
    metrics = {
        "loss": to_float(out.logged_loss if out.logged_loss is not None else out.policy_loss),
        "entropy": to_float(alg.masked_mean(entropy, fmask)),
    }
    if out.is_low_clipped is not None and out.is_high_clipped is not None:
        low, high = out.is_low_clipped, out.is_high_clipped
        metrics["clip_ratio/low_mean"] = to_float(alg.masked_mean(low.float(), fmask))
        metrics["clip_ratio/high_mean"] = to_float(alg.masked_mean(high.float(), fmask))
        metrics["clip_ratio/region_mean"] = to_float(alg.masked_mean((low | high).float(), fmask))
    for name, value in out.extra.items():
        metrics[name] = to_float(alg.masked_mean(value.float(), fmask))
    if out.kl is not None:
        metrics["kl"] = to_float(alg.masked_mean(out.kl.detach(), fmask))
    if entropy_coef != 0.0:
        metrics["policy_loss"] = to_float(out.policy_loss)
        metrics["entropy_coef"] = entropy_coef
    return metrics


class Optimization:
    """Trains the policy on generation batches and keeps a synchronised reference (``sync_ref_model``) in step.

    ``model``, ``optimizer``: as the accelerator prepared them; ``scheduler``: the learning-rate schedule;
    ``vision_params``: the policy's trainable vision parameters; ``ref_model``: the separate reference model (None
    without a KL term, or with LoRA, where the reference is the policy with its adapters disabled).
    """

    def __init__(
        self,
        config: RunConfig,
        accelerator: Any,
        model: Any,
        optimizer: Any,
        scheduler: Any,
        settings: alg.GRPOLossSettings,
        passes: ForwardPasses,
        vision_params: list[torch.nn.Parameter],
        ref_model: Any | None,
    ):
        self.config = config
        self.accelerator = accelerator
        self.model = model
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.settings = settings
        self.passes = passes
        self.vision_params = vision_params
        self.ref_model = ref_model
        self.world = accelerator.num_processes

    def learning_rate(self) -> float:
        """The learning rate the next optimizer step uses."""
        return self.scheduler.get_last_lr()[0]

    # ------------------------------------------------------------------ loss
    def micro_step(self, gen: GenerationBatch, index: int, sync: bool) -> dict[str, float]:
        """Forward and backward of micro-batch ``index`` of ``gen``; its loss-side metrics. ``sync``: the optimizer
        step's last micro-batch, whose backward all-reduces the accumulated gradients across processes."""
        cfg, t = self.config, self.config.train
        size = t.per_device_train_batch_size
        lo, hi = index * size, (index + 1) * size
        mb = gen.batch.slice(lo, hi, self.passes.family.layout).trimmed()  # padded to its own longest rows only
        c = mb.completion_mask.shape[1]
        advantages = gen.advantages[lo:hi]
        old = None if gen.old_logps is None else gen.old_logps[lo:hi, :c]
        ref = None if gen.ref_logps is None else gen.ref_logps[lo:hi, :c]
        mask = mb.completion_mask
        context = torch.enable_grad() if sync else self.accelerator.no_sync(self.model)
        with context:
            logps, entropy = self._logps_for_loss(mb)
            if cfg.algorithm == "grpo":
                out = alg.grpo_loss(
                    logps,
                    old,
                    advantages,
                    mask,
                    self.settings,
                    ref_logps=ref,
                    num_items_in_batch=gen.num_items,
                    entropies=entropy,
                    entropy_mask=self._entropy_mask(entropy, mask),
                )
            else:
                out = alg.rloo_loss(
                    logps, old, advantages, mask, t.epsilon_low, t.epsilon_high_value, t.gradient_accumulation_steps
                )
            loss = out.loss
            if self.world > 1 and not mb.pixels and self.vision_params:
                # DDP all-reduces a fixed set of gradients: a micro-batch without images must still give the
                # trainable vision parameters a (zero) gradient, or ranks disagree and DDP fails (TRL #4169)
                loss = loss + 0.0 * sum(p.sum() for p in self.vision_params)
            self.accelerator.backward(loss)
        return loss_metrics(out, entropy.detach(), mask, t.entropy_coef if cfg.algorithm == "grpo" else 0.0)

    def _logps_for_loss(self, mb: ModelBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """Log-probs and entropies of a micro-batch; the entropies carry gradients when the entropy bonus
        (``entropy_coef``) trains through them."""
        t = self.config.train
        entropy_grad = self.config.algorithm == "grpo" and t.entropy_coef != 0.0
        passes = self.passes
        logps, entropy = passes.logps(self.model, mb, passes.scope("train"), entropy=True, entropy_grad=entropy_grad)
        assert entropy is not None
        return logps, entropy

    def _entropy_mask(self, entropy: torch.Tensor, mask: torch.Tensor) -> torch.Tensor | None:
        """``top_entropy_quantile``: the threshold is the quantile over every process's completion tokens of the
        micro-batch, as in TRL."""
        t = self.config.train
        if self.config.algorithm != "grpo" or t.top_entropy_quantile >= 1.0:
            return None
        local = entropy.detach()[mask.bool()].float()
        pool = local
        if self.world > 1:
            pad = -1e9  # entropies are >= 0, so the sentinel cannot collide with a real value
            gathered = self.accelerator.gather(self.accelerator.pad_across_processes(local, dim=0, pad_index=pad))
            pool = gathered[gathered != pad]
        return alg.high_entropy_mask(entropy.detach(), mask, t.top_entropy_quantile, pool)

    # ------------------------------------------------------------------ step
    def apply_gradients(self) -> Any:
        """The optimizer step on the accumulated gradients, clipped to ``max_grad_norm``, then the scheduler's;
        the gradient norm before clipping."""
        grad_norm = full_grad_norm(
            self.accelerator.clip_grad_norm_(self.model.parameters(), self.config.train.max_grad_norm)
        )
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return grad_norm

    # ------------------------------------------------------------- reference
    def sync_reference(self, step: int) -> None:
        """``sync_ref_model`` (TR-DPO): every ``ref_model_sync_steps`` optimizer steps the reference moves towards
        the policy, ``ref = alpha * policy + (1 - alpha) * ref``, as TRL's ``SyncRefModelCallback`` does."""
        t = self.config.train
        if self.ref_model is None or not t.sync_ref_model or step % t.ref_model_sync_steps:
            return
        policy = dict(self.accelerator.unwrap_model(self.model).named_parameters())
        names = [n for n, _ in self.ref_model.named_parameters()]
        alg.mix_into_reference(
            [p for _, p in self.ref_model.named_parameters()], [policy[n] for n in names], t.ref_model_mixup_alpha
        )

    def reference_state(self) -> dict[str, torch.Tensor] | None:
        """The synchronised reference's weights for a checkpoint (``None`` when the reference never moves: it is
        then the initial policy, rebuilt on resume)."""
        if self.ref_model is None or not self.config.train.sync_ref_model or is_sharded(self.ref_model):
            return None  # never moved, or sharded: a sharded run's checkpoint shards hold it
        return {k: v.detach().cpu().clone() for k, v in self.ref_model.state_dict().items()}

    def restore_reference(self, saved: dict[str, torch.Tensor] | None, step: int) -> None:
        """On resume at ``step``, a reference that ``sync_ref_model`` has moved must come back from the checkpoint
        (``saved``: the checkpoint's ``ref_model``)."""
        t = self.config.train
        if self.ref_model is None or not t.sync_ref_model or step < t.ref_model_sync_steps:
            return
        if saved is None:
            raise TrainingError(
                f"resume: train.sync_ref_model: the checkpoint at step {step} does not hold the synchronised "
                "reference model, so the run cannot continue with the same reference"
            )
        self.ref_model.load_state_dict(saved)
