"""GRPO: group-relative advantages and the clipped policy-gradient loss (optional KL).

Each prompt is sampled `group` times; a sample's advantage is its reward minus the group's mean,
over the group's standard deviation, so no value model is needed. The loss is PPO's clipped
surrogate over the completion's tokens, with the rollout engine's logprobs as the behaviour
policy: the samples may come from weights one step older than the trainer's (one-step
off-policy), and the ratio corrects for it.
"""

from __future__ import annotations

import torch

__all__ = ["group_advantages", "policy_loss"]


def group_advantages(rewards: torch.Tensor, groups: torch.Tensor, eps: float = 1e-4) -> torch.Tensor:
    """Each reward minus its group's mean, over its group's standard deviation.

    Args:
        rewards: [samples] one reward per sample.
        groups: [samples] the prompt each sample answers; groups may differ in size (samples
            dropped as too stale leave smaller groups). A group of one gets advantage 0.
    """
    advantages = torch.zeros_like(rewards)
    for group in groups.unique():
        members = groups == group
        values = rewards[members]
        if values.numel() > 1:
            advantages[members] = (values - values.mean()) / (values.std() + eps)
    return advantages


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip: float = 0.2,
    ref_logprobs: torch.Tensor | None = None,
    kl_coef: float = 0.0,
) -> torch.Tensor:
    """The clipped surrogate (negated, to minimise), averaged over completion tokens.

    Args:
        logprobs: [batch, tokens] the trainer's logprobs of the sampled tokens.
        old_logprobs: [batch, tokens] the rollout engine's logprobs of the same tokens.
        advantages: [batch] one per sample.
        mask: [batch, tokens] 1 for completion tokens, 0 for padding.
        ref_logprobs: [batch, tokens] a frozen reference policy's, for the KL penalty.
        kl_coef: weight of the KL penalty (the k3 estimator), 0 to disable.
    """
    ratio = torch.exp(logprobs - old_logprobs)
    adv = advantages[:, None]
    surrogate = torch.minimum(ratio * adv, torch.clamp(ratio, 1 - clip, 1 + clip) * adv)
    per_token = -surrogate
    if ref_logprobs is not None and kl_coef > 0:
        log_ratio = ref_logprobs - logprobs
        per_token = per_token + kl_coef * (torch.exp(log_ratio) - log_ratio - 1)
    return (per_token * mask).sum() / mask.sum().clamp(min=1)
