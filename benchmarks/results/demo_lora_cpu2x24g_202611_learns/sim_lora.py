"""The LoRA demo's learning, simulated in one process: the demo's own policy, pretraining, LoRA
wrapping, GRPO step and learning-rate schedule, with the rollout servers replaced by sampling
from a copy of the policy one step old (the demo's one-step lag). About 15-60 s a run on the
2-core host: used to find why `weightsync demo --lora` did not learn reliably.

    python sim_lora.py --seed 0 [--rank 4] [--lr 7e-3] [--final 0.1] [--kl 0.05] [--steps 300]

Prints the mean reward over the first and last tenth of steps, and the policy's most likely
first answer digit for each prompt "0=" .. "9=" at the end (the task wants "1234567890").
For the rows measured on the pretraining before the fix, run it on that commit's task.py.
"""

import argparse
import copy
import functools
import random
import time
from pathlib import Path

import torch

from weightsync.demo import loop, task
from weightsync.demo.rollouts import Sample

parser = argparse.ArgumentParser()
parser.add_argument("--seed", type=int, default=0)
parser.add_argument("--steps", type=int, default=300)
parser.add_argument("--rank", type=int, default=4)
parser.add_argument("--lr", type=float, default=7e-3)
parser.add_argument("--final", type=float, default=0.1)
parser.add_argument("--kl", type=float, default=0.0)
parser.add_argument("--pretrain", type=int, default=300)
args = parser.parse_args()
torch.set_num_threads(1)
policy = task.build_policy(Path(f"/tmp/sim_lora_{args.seed}"), seed=args.seed)
task.pretrain(policy, args.pretrain, seed=args.seed)
reference = copy.deepcopy(policy).requires_grad_(False) if args.kl > 0 else None
config = loop.DemoConfig(
    steps=args.steps, lr=args.lr, final_lr_fraction=args.final, lora_rank=args.rank, seed=args.seed, kl_coef=args.kl
)
model = loop.with_adapter(policy, args.rank)
optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=args.lr, weight_decay=0.0)
schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, functools.partial(loop.lr_factor, config=config))
rng, generator = random.Random(args.seed), torch.Generator().manual_seed(args.seed)


@torch.no_grad()
def sample(version: int) -> list[Sample]:
    """16 prompts x 8 samples at temperature 1 from the model as it is now."""
    digits = task.sample_digits(rng, 16)
    prompts = torch.tensor([task.encode(task.prompt_text(d)) for d in digits]).repeat_interleave(8, 0)
    ids, tokens, logprobs = prompts, [], []
    for _ in range(task.ANSWER_LENGTH):
        logp = torch.log_softmax(model(input_ids=ids).logits[:, -1].float(), -1)
        token = torch.multinomial(logp.exp(), 1, generator=generator)[:, 0]
        tokens.append(token)
        logprobs.append(logp.gather(-1, token[:, None])[:, 0])
        ids = torch.cat([ids, token[:, None]], 1)
    samples = []
    for row in range(len(ids)):
        completion, lps = [], []
        for position in range(task.ANSWER_LENGTH):
            completion.append(int(tokens[position][row]))
            lps.append(float(logprobs[position][row]))
            if completion[-1] == task.EOS_ID:
                break
        samples.append(Sample(row // 8, prompts[row].tolist(), completion, lps, version))
    return samples


started, means = time.time(), []
samples = sample(0)
for step in range(args.steps):
    rewards = [task.reward(loop.task_digit(s), s.completion_ids) for s in samples]
    following = sample(step + 1)  # on the weights before this step's update: one step behind, as the demo
    loop.train_step(model, reference, optimizer, samples, rewards, config)
    schedule.step()
    samples = following
    means.append(sum(rewards) / len(rewards))
tenth = max(args.steps // 10, 1)
with torch.no_grad():
    prompts = torch.tensor([task.encode(task.prompt_text(d)) for d in range(10)])
    best = model(input_ids=prompts).logits[:, -1].argmax(-1).tolist()
names = task.SPECIAL + task.CHARS
print(
    f"seed {args.seed} rank {args.rank} lr {args.lr} final {args.final} kl {args.kl}: "
    f"{sum(means[:tenth]) / tenth:.3f} -> {sum(means[-tenth:]) / tenth:.3f} "
    f"answers {''.join(names[i] for i in best)} ({time.time() - started:.0f} s)"
)
