"""TRL's GRPO trainers with weightsync rollout servers (`weightsync serve`), on any device.

TRL's own paths to vLLM need CUDA: server mode joins vLLM's NCCL group, and colocate mode's
sync (`load_weights` on an in-process engine) fails on vLLM's CPU backend. TRL has two doors a weight-sync engine can use without
patching it, and this module fills both (tested with TRL 1.16.0, the `weightsync[trl]` extra):

- `WeightsyncRollout`, a `GRPOTrainer(rollout_func=...)`: before each generation that follows an
  optimizer step it pushes the trainer's model to the servers (each server's receiver, over the transport it was started
  with), then generates through their OpenAI API with token ids and logprobs. Each sample's
  `weight_version` goes on to the reward functions (a keyword argument) and, through
  `log_weight_versions`, to TRL's completion logs and metrics. TRL then does no sync of its own
  (`use_vllm=False`).

      rollout = WeightsyncRollout(["http://127.0.0.1:8000", "http://127.0.0.1:8001"])
      trainer = GRPOTrainer(model, reward_funcs=..., args=GRPOConfig(..., use_vllm=False),
                            train_dataset=..., rollout_func=rollout)

- `WeightsyncTransfer`, `AsyncGRPOTrainer(weight_transfer=...)`: TRL's weight-transfer protocol
  (`init_weight_transfer`, `pause`, `send_weights(iterator)`, `resume`, `destroy`) over the
  same servers.

Both push with a `SenderOptions` (`sender=`; default: verified pushes, `verify="bucket"`). A
push that does not commit on a server is never passed over: `WeightsyncRollout` stops generating
on that server (a warning says why) and fails once none is left; `WeightsyncTransfer` raises
`SyncFailed`.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from weightsync.client import ServerGroup
from weightsync.errors import ConfigError, ResourceError, ServerError, SyncFailed
from weightsync.lora import adapter_from_peft, base_from_peft
from weightsync.module_source import ModuleSource
from weightsync.options import SenderOptions
from weightsync.report import SyncReport
from weightsync.source import StateDictSource

__all__ = [
    "REQUIRED_KEYS",
    "TESTED_TRL",
    "WeightsyncRollout",
    "WeightsyncTransfer",
    "log_weight_versions",
]

log = logging.getLogger(__name__)

TESTED_TRL = "1.16.0"
"""The TRL release this module is written and tested against (pinned by `weightsync[trl]`)."""
REQUIRED_KEYS = ("prompt_ids", "completion_ids", "logprobs")
"""What TRL requires of a rollout function's result; every other key goes to the reward functions."""


def push_options(sender: SenderOptions | None, *, raise_on_failure: bool) -> SenderOptions:
    """How a TRL door pushes: `sender` (default: `verify="bucket"`, which also leaves every server
    with the content digest of what it holds: `weightsync digest`), with the door's own
    `raise_on_failure`. Its `timeout` bounds any single wait (the start-up of all the servers, an
    HTTP call, a step of a push)."""
    return dataclasses.replace(sender or SenderOptions(verify="bucket"), raise_on_failure=raise_on_failure)


def connect(urls: Sequence[str], sender: SenderOptions) -> ServerGroup:
    """The rollout servers at `urls` (`weightsync serve`) as one `ServerGroup` that pushes with
    `sender`, once every one is up (its engine loaded).

    Args:
        urls: the servers' base URLs.
        sender: how to push (`push_options`). With `raise_on_failure=False`, `push` returns the
            report instead of raising `SyncFailed`, and `live` says which servers are left.

    Raises:
        ServerError: a server that was not up within the timeout (the first of them).
    """
    if not urls:
        raise ConfigError("give at least one rollout server URL")
    group = ServerGroup(sender)
    try:
        _, errors = group.join(urls)
        if errors:
            raise next(iter(errors.values()))
    except BaseException:
        group.close()
        raise
    return group


@dataclasses.dataclass(frozen=True, slots=True)
class _Group:
    """Consecutive copies of one prompt in TRL's batch: one request with `n` completions."""

    start: int
    size: int
    prompt_ids: list[int]


BATCH_SEEDS = 10_007
"""Seeds each generation batch may use: batches of more completions than this share none less
often than not (a batch of TRL's is far smaller)."""


def request_seed(seed: int | None, step: int, group: _Group) -> int | None:
    """The seed of `group`'s request at `step`, from TRL's `seed` (None: unseeded). A server
    draws completion k of a request with its seed + k (vLLM does too), so the request starts at
    the group's place in the batch: every completion of a batch has a seed of its own, and each
    step's seeds lie apart from every other step's."""
    if seed is None:
        return None
    return (seed * 1_000_003 + step) * BATCH_SEEDS + group.start


class WeightsyncRollout:
    """A `rollout_func` for TRL's `GRPOTrainer` that generates on weightsync rollout servers.

    Called by TRL as `rollout(prompts, trainer)` once per generation batch. When the trainer's
    `global_step` moved since the last push (and at the first call), it pushes the trainer's model
    as version `global_step`; then each run of identical prompts in the batch (TRL repeats every
    prompt `num_generations` times) becomes one completions request with `n` set to its length,
    spread over the live servers. Sampling follows the trainer's `GRPOConfig`
    (`max_completion_length`, `temperature`, `top_p`, `top_k`, `seed`).

    A PEFT model (`GRPOTrainer(peft_config=LoraConfig(...))`) is pushed as a LoRA adapter: its
    base weights once, at the first call, as version 0, then only the adapter, as `adapter_name`,
    which every request names (the servers run with `--max-lora-rank`; docs/lora.md).

    The result holds TRL's keys and `weight_version`: for each sample, the oldest weight version
    that produced any of its tokens (with an adapter: the adapter's version). A sample more than `max_staleness` versions behind the
    trainer's step is kept out of the loss (an all-zero `env_mask` row), as the demo drops it;
    pushing before generating keeps every sample at lag 0, so this only catches a server serving
    weights other than the ones just pushed.

    Args:
        urls: the rollout servers' base URLs.
        max_staleness: versions a sample may lag the trainer's step and still train.
        adapter_name: the name a PEFT model's adapter is served under.
        sender: how to push (`push_options`; the rollout's `raise_on_failure` is False).
    """

    def __init__(
        self,
        urls: Sequence[str],
        *,
        max_staleness: int = 0,
        adapter_name: str = "policy",
        sender: SenderOptions | None = None,
    ) -> None:
        self.adapter_name = adapter_name
        self._model: dict[str, str] = {}
        """The `model` field of every request: the adapter's name once one is pushed."""
        if max_staleness < 0:
            raise ConfigError(f"max_staleness must be 0 or more, got {max_staleness}")
        self.max_staleness = max_staleness
        # a server that fails a push leaves `servers.live`; generation goes on with the others
        self.servers = connect(urls, push_options(sender, raise_on_failure=False))
        self.version: int | None = None
        """The version last pushed (the trainer's `global_step` then)."""
        self.reports: list[SyncReport] = []
        """One per push, in order."""
        self._pool = ThreadPoolExecutor(8, thread_name_prefix="weightsync-trl-rollout")

    def __call__(self, prompts: list[Any], trainer: Any) -> dict[str, list[Any]]:
        step = int(trainer.state.global_step)
        if self.version != step:
            self.push(trainer, step)
        prompt_ids = [tokenize(trainer.processing_class, prompt) for prompt in prompts]
        groups = group_prompts(prompts, prompt_ids)
        fields = sampling_fields(trainer.args)
        seeds = [request_seed(trainer.args.seed, step, group) for group in groups]
        jobs = [
            self._pool.submit(self._complete, index, group, fields, seed)
            for index, (group, seed) in enumerate(zip(groups, seeds, strict=True))
        ]
        results = [job.result(timeout=self.servers.timeout * 2) for job in jobs]
        completion_ids: list[list[int]] = []
        logprobs: list[list[float]] = []
        versions: list[int] = []
        for choices in results:
            for choice in choices:
                completion_ids.append(list(choice["token_ids"]))
                logprobs.append(list(choice["logprobs"]["token_logprobs"]))
                versions.append(choice_version(choice))
        output: dict[str, list[Any]] = {
            "prompt_ids": prompt_ids,
            "completion_ids": completion_ids,
            "logprobs": logprobs,
            "weight_version": versions,
        }
        if any(step - v > self.max_staleness for v in versions):
            output["env_mask"] = [
                [int(step - v <= self.max_staleness)] * len(ids)
                for v, ids in zip(versions, completion_ids, strict=True)
            ]
        return output

    def push(self, trainer: Any, version: int) -> SyncReport | None:
        """Push the trainer's model as `version`. Under DDP the main process pushes (the others
        get None) and every process waits for it."""
        accelerator = trainer.accelerator
        model = accelerator.unwrap_model(trainer.model)
        report = None
        if accelerator.is_main_process:
            report = self._push(model, version)
            self.reports.append(report)
            log.info("pushed version %d: %d bytes in %.3f s", version, report.total_bytes, report.seconds)
        accelerator.wait_for_everyone()
        if not self.servers.live:
            raise SyncFailed(f"no rollout server committed version {version}", report)
        self.version = version
        return report

    def _push(self, model: Any, version: int) -> SyncReport:
        if getattr(model, "peft_config", None) is None:
            return self.servers.push(ModuleSource(model), version)
        if self.version is None:  # what the adapter sits on, once
            base = self.servers.push(base_from_peft(model), 0)
            if not self.servers.live:
                raise SyncFailed("no rollout server committed the base weights under the adapter", base)
        tensors, adapter = adapter_from_peft(model, self.adapter_name)
        self._model = {"model": adapter.name}
        return self.servers.push(tensors, version, adapter=adapter)

    def _complete(self, index: int, group: _Group, fields: dict[str, Any], seed_value: int | None) -> list[Any]:
        """`group.size` completions of one prompt, from one server (round robin); a server that
        fails is left out and the request goes to the next."""
        while True:
            live = list(self.servers.live)
            if not live:
                raise ResourceError("every rollout server is down")
            client = live[index % len(live)]
            seed = {} if seed_value is None else {"seed": seed_value}
            try:
                body = client.completions(group.prompt_ids, n=group.size, logprobs=0, **seed, **fields, **self._model)
            except ServerError as exc:
                if 400 <= exc.status < 500:  # the request itself is wrong: every server would refuse it
                    raise
                self.servers.drop(client.base_url, f"failed a request ({exc})")
                continue
            choices = body["choices"]
            if len(choices) != group.size:
                raise ResourceError(f"{client.base_url} answered {len(choices)} choices, asked for {group.size}")
            return list(choices)

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
        self.servers.close()

    def __enter__(self) -> WeightsyncRollout:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def tokenize(tokenizer: Any, prompt: Any) -> list[int]:
    """A prompt's token ids, as TRL's own generation makes them: a chat (a list of messages)
    through the chat template with the generation prompt, text as it is."""
    if isinstance(prompt, str):
        return list(tokenizer(text=[prompt])["input_ids"][0])
    rendered = tokenizer.apply_chat_template(
        conversation=[prompt], add_generation_prompt=True, tokenize=True, return_dict=True
    )
    return list(rendered["input_ids"][0])


def group_prompts(prompts: Sequence[Any], prompt_ids: Sequence[list[int]]) -> list[_Group]:
    """Runs of consecutive identical prompts (TRL's sampler repeats each one)."""
    groups: list[_Group] = []
    for index, prompt in enumerate(prompts):
        if groups and prompts[groups[-1].start] == prompt:
            last = groups[-1]
            groups[-1] = dataclasses.replace(last, size=last.size + 1)
        else:
            groups.append(_Group(index, 1, list(prompt_ids[index])))
    return groups


def sampling_fields(args: Any) -> dict[str, Any]:
    """The completions request's sampling fields from a `GRPOConfig`: only those set away from
    the neutral value (a server that lacks one then still answers)."""
    fields: dict[str, Any] = {"max_tokens": args.max_completion_length, "temperature": args.temperature}
    if args.top_p is not None and args.top_p != 1.0:
        fields["top_p"] = args.top_p
    if args.top_k:
        fields["top_k"] = args.top_k
    return fields


def choice_version(choice: dict[str, Any]) -> int:
    """The oldest weight version that produced any token of a choice."""
    spans = choice.get("weight_versions") or []
    return int(min((span["version"] for span in spans), default=choice["weight_version"]))


def log_weight_versions(reward_func: Callable[..., list[float | None]]) -> Callable[..., list[float | None]]:
    """Wrap a reward function so that TRL logs each completion's `weight_version` (a column of
    the completions table) and the batch's newest and oldest versions (metrics), then scores as
    `reward_func` does. Needs a rollout function that returns `weight_version`, as
    `WeightsyncRollout` does."""

    @functools.wraps(reward_func)
    def wrapped(*args: Any, **kwargs: Any) -> list[float | None]:
        versions = kwargs.get("weight_version")
        if versions is None:
            raise ConfigError(
                "no weight_version among the reward function's arguments: is the rollout_func weightsync's?"
            )
        if kwargs.get("log_extra") is not None:
            kwargs["log_extra"]("weight_version", list(versions))
        if kwargs.get("log_metric") is not None:
            kwargs["log_metric"]("weight_version/max", float(max(versions)))
            kwargs["log_metric"]("weight_version/min", float(min(versions)))
        return reward_func(*args, **kwargs)

    return wrapped


class WeightsyncTransfer:
    """TRL's weight-transfer protocol (`AsyncGRPOTrainer(weight_transfer=...)`) over weightsync
    rollout servers.

    TRL calls `init_weight_transfer` once when training begins, then for every sync `pause`,
    `send_weights(iterator)`, `resume`, and `destroy` when training ends, all on the main
    process. Each `send_weights` pushes the iterator's tensors as the next version (1, 2, ...:
    the numbering of the trainer's `model_version`). The tensors are held, by reference, until
    the push ends: no copy where they are the parameters themselves; under FSDP2 every gathered
    parameter is held at once. A push that does not commit on every server raises `SyncFailed`.

    Args:
        urls: the rollout servers' base URLs.
        pause_mode: what `pause` does to requests in flight: "wait" (let them finish), "abort",
            or "keep" (freeze them; they go on with the new weights).
        sender: how to push (`push_options`; TRL's protocol raises: `raise_on_failure` True).
    """

    def __init__(self, urls: Sequence[str], *, pause_mode: str = "keep", sender: SenderOptions | None = None) -> None:
        if pause_mode not in ("wait", "abort", "keep"):
            raise ConfigError(f"pause_mode must be 'wait', 'abort' or 'keep', got {pause_mode!r}")
        self.urls = list(urls)
        self.pause_mode = pause_mode
        self._sender = push_options(sender, raise_on_failure=True)
        self.servers: ServerGroup | None = None
        self.version = 0
        """The version last sent (0: none yet)."""
        self.reports: list[SyncReport] = []

    def init_weight_transfer(self) -> None:
        """Wait for the servers and connect to their receivers."""
        if self.servers is None:
            self.servers = connect(self.urls, self._sender)

    def pause(self) -> None:
        for client in self._servers().clients:
            client.pause(self.pause_mode, timeout=self._servers().timeout)

    def send_weights(self, iterator: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Push every (name, tensor) of `iterator` as the next version."""
        servers = self._servers()
        source = StateDictSource(list(iterator))
        try:
            report = servers.push(source, self.version + 1)  # raises SyncFailed unless every server committed
        except SyncFailed as exc:
            self.reports.append(exc.report)  # type: ignore[arg-type]  # ServerGroup's is a SyncReport
            raise
        self.reports.append(report)
        self.version = report.version

    def resume(self) -> None:
        for client in self._servers().clients:
            client.resume()

    def destroy(self) -> None:
        if self.servers is not None:
            self.servers.close()
            self.servers = None

    def _servers(self) -> ServerGroup:
        if self.servers is None:
            raise ResourceError("init_weight_transfer() has not been called (or destroy() has)")
        return self.servers
