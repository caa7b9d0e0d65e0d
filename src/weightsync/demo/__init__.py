"""`weightsync demo`: a real GRPO run that syncs weights to rollout engines after every step.

task.py the verifiable task and its tokenizer; grpo.py advantages and the clipped loss;
rollouts.py where samples come from (an in-process engine, or a fleet of `weightsync serve`
processes); loop.py the training loop; report.py steps.jsonl, the plot and the summary.
"""
