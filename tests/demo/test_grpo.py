"""GRPO's pieces and the task's checker."""

from __future__ import annotations

import math

import torch

from weightsync.demo import grpo, task
from weightsync.demo.loop import fresh
from weightsync.demo.rollouts import Sample


def test_group_advantages_normalise_within_each_group() -> None:
    rewards = torch.tensor([1.0, 0.0, 0.5, 0.5, 0.2, 0.2, 0.9])
    groups = torch.tensor([0, 0, 1, 1, 2, 2, 3])
    adv = grpo.group_advantages(rewards, groups)
    assert adv[0] > 0 > adv[1] and math.isclose(adv[0].item(), -adv[1].item(), rel_tol=1e-6)
    assert adv[2:6].abs().max() == 0  # equal rewards: no signal
    assert adv[6] == 0  # a group of one (its siblings dropped as stale): no signal


def test_policy_loss_is_the_clipped_surrogate() -> None:
    old = torch.zeros(2, 3)
    new = torch.tensor([[0.5, 0.0, 0.0], [-0.5, 0.0, 0.0]], requires_grad=True)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 0.0]])
    adv = torch.tensor([1.0, -1.0])
    loss = grpo.policy_loss(new, old, adv, mask, clip=0.2)
    # token (0,0): ratio e^.5 clipped to 1.2 (A>0); (1,0): ratio e^-.5 clipped to 0.8 (A<0);
    # the others: ratio 1. Mean over the 4 unmasked tokens of -min(r*A, clip(r)*A).
    expected = -(1.2 + 1.0 - 0.8 - 1.0) / 4
    assert math.isclose(loss.item(), expected, rel_tol=1e-6)
    loss.backward()
    assert new.grad[0, 0] == 0 and new.grad[1, 0] == 0  # clipped tokens carry no gradient
    assert new.grad[0, 2] == 0  # masked


def test_kl_penalty_is_zero_at_the_reference_and_positive_away_from_it() -> None:
    lp = torch.log(torch.tensor([[0.5, 0.25]]))
    mask = torch.ones(1, 2)
    zero = torch.zeros(1)
    assert grpo.policy_loss(lp, lp, zero, mask, ref_logprobs=lp, kl_coef=1.0).item() == 0
    assert grpo.policy_loss(lp, lp, zero, mask, ref_logprobs=lp - 0.3, kl_coef=1.0).item() > 0


def test_reward_checks_each_position() -> None:
    assert task.reward(3, task.encode("4444")) == 1.0
    assert task.reward(9, task.encode("0000")) == 1.0
    assert task.reward(3, task.encode("4") + [task.EOS_ID]) == 0.25
    assert task.reward(3, task.encode("5444")) == 0.75
    assert task.reward(3, []) == 0.0


def test_staleness_bound_drops_older_samples() -> None:
    samples = [Sample(0, [1], [2], [0.0], version) for version in (3, 4, 5)]
    kept, dropped = fresh(samples, version=5, max_staleness=1)
    assert [s.weight_version for s in kept] == [4, 5] and dropped == 1
    assert fresh(samples, version=5, max_staleness=0)[1] == 2


def test_the_learning_rate_falls_linearly_to_its_final_fraction() -> None:
    """A LoRA run's rate falls to a tenth by its last step: a constant one walked a learned policy
    off the task once nearly every group was all correct (Adam keeps its step size)."""
    from weightsync.demo.loop import DemoConfig, lr_factor

    config = DemoConfig(steps=11, final_lr_fraction=0.1)
    assert [round(lr_factor(step, config), 2) for step in (0, 5, 10)] == [1.0, 0.55, 0.1]
    assert lr_factor(7, DemoConfig(steps=11)) == 1.0  # the default: constant


def test_the_lora_base_samples_every_right_answer_at_about_chance(tmp_path) -> None:
    """After its pretraining the LoRA demo's base has not learned the task, yet samples each
    digit's right answer about one time in ten: GRPO learns only answers it samples (left
    untaught, some right answers had odds below 1 in 1000 and were never learned)."""
    policy = task.build_policy(tmp_path, seed=0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the demo does: tiny matrices, where threads only contend
    try:
        task.pretrain(policy, 300, seed=0)
    finally:
        torch.set_num_threads(threads)
    prompts = torch.tensor([task.encode(task.prompt_text(d)) for d in range(10)])
    with torch.no_grad():
        first = torch.softmax(policy(input_ids=prompts).logits[:, -1], dim=-1)
    right = first[range(10), [task.VOCAB[str((d + 1) % 10)] for d in range(10)]]
    assert 0.04 < right.min() and right.max() < 0.2, right


def test_a_lora_run_defaults_to_a_kl_penalty_and_a_falling_rate() -> None:
    from weightsync.cli import build_parser
    from weightsync.cli.demo import demo_config

    lora = demo_config(build_parser().parse_args(["demo", "--lora"]), "hf")
    assert (lora.kl_coef, lora.final_lr_fraction, lora.lora_rank, lora.steps) == (0.05, 0.1, 4, 300)
    full = demo_config(build_parser().parse_args(["demo"]), "hf")
    assert (full.kl_coef, full.final_lr_fraction, full.lora_rank, full.steps) == (0.0, 1.0, 0, 80)
    assert demo_config(build_parser().parse_args(["demo", "--lora", "--kl-coef", "0"]), "hf").kl_coef == 0.0


def test_every_sample_of_a_demo_run_is_drawn_with_a_seed_of_its_own() -> None:
    """Sample k of prompt i is drawn with the request's seed + i x group + k (Request.seed): no
    two samples of a step, nor of two steps, nor of two runs' seeds, share one. Shared seeds
    sampled a prompt with the same random numbers step after step: it explored no further."""
    import random

    from weightsync.demo.loop import DemoConfig, new_request

    seeds = []
    for run_seed in (0, 1):
        config, rng = DemoConfig(seed=run_seed), random.Random(run_seed)
        for step in range(40):
            request = new_request(config, rng, step)
            seeds += [request.seed + i * config.group + k for i in range(len(request.prompts)) for k in range(8)]
    assert len(set(seeds)) == len(seeds) == 2 * 40 * 16 * 8


def test_a_rollout_server_gets_one_request_per_prompt_seeded_for_that_prompt() -> None:
    """The servers (as vLLM's) seed sample k of every prompt of a request with its seed + k: one
    request for several prompts would sample them all with the same random numbers."""
    import json

    import httpx

    from weightsync.demo.rollouts import Request, complete_one

    bodies = []

    def answer(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        bodies.append(body)
        choice = {"token_ids": [4], "logprobs": {"token_logprobs": [-0.1]}, "weight_versions": [], "weight_version": 3}
        return httpx.Response(200, json={"choices": [choice] * body["n"]})

    request = Request([[3, 13], [5, 13]], group=4, max_tokens=4, temperature=1.0, seed=1000)
    with httpx.Client(transport=httpx.MockTransport(answer), base_url="http://server") as client:
        samples = complete_one(client, request, 1, [5, 13])
    assert [(b["prompt"], b["n"], b["seed"]) for b in bodies] == [([[5, 13]], 4, 1000 + 1 * 4)]
    assert [(s.prompt_index, s.prompt_ids, s.weight_version) for s in samples] == [(1, [5, 13], 3)] * 4
