"""weightsync as vLLM's own weight-transfer backend, end to end on stock vLLM.

A real `python -m vllm.entrypoints.openai.api_server` (what `vllm serve` runs) starts on dummy
weights with `--weight-transfer-config '{"backend": "weightsync"}'`, at tensor parallel size 1
and 2. The trainer side is written only against vLLM's own trainer API
(`WeightTransferTrainerFactory`, `HTTPVLLMWeightSyncClient`, vLLM's `ModuleSource`), with
`WeightsyncTrainerInitInfo` as the one weightsync name (and, for the MoE, `HFCheckpointSource`
wrapped as vLLM's source by `VLLMSource`). Checked on two tiny models: a dense Qwen2 (one KV
head, replicated under TP=2; tied embeddings; biases), pushed from vLLM's `ModuleSource`, and a
Qwen3-MoE (4 experts, top-2), whose transformers 5 model stacks its experts while the checkpoint
and vLLM's loader have one tensor per expert. Every push is bit-exact (the committed content
digest equals that of the checkpoint's own tensors), greedy output equals transformers' on the
same weights, and, pushed in buckets that split layers, what every worker serves equals vLLM's
own reload of the checkpoint (vLLM's per-parameter checksums); a plan with a tensor twice and another missing, an empty sync and (MoE) the
fused stacks as transformers holds them fail loudly and label no version; a push outside vLLM's
update window is refused; a round the workers refuse (the trainer's token, a plan the receiver
refuses) raises at once, not after the timeout, leaves what every worker serves as it was, and
the next round lands and is labelled.

Skipped where vLLM is not installed (scripts/install-vllm.sh installs it).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import os
import re
import runpy
import shlex
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch

pytest.importorskip("vllm")

from vllm.distributed.weight_transfer.base import ModuleSource, ParamMeta  # noqa: E402
from vllm.distributed.weight_transfer.base import WeightSource as VLLMWeightSource  # noqa: E402
from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient  # noqa: E402
from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory  # noqa: E402

from tests.doc_snippets import snippet, write_program  # noqa: E402
from tests.helpers import free_port  # noqa: E402
from tests.integrations.test_one_round import FAULTS, Target, _the_rule_holds  # noqa: E402
from tests.leftovers import Footprints  # noqa: E402
from tests.models import save_model  # noqa: E402
from weightsync import HFCheckpointSource, SenderOptions, SyncFailed, WeightSender  # noqa: E402
from weightsync.digest import source_digest  # noqa: E402
from weightsync.integrations.vllm import VLLMSource, WeightsyncTrainerInitInfo  # noqa: E402
from weightsync.serving.process import ChildProcess  # noqa: E402

pytestmark = [
    pytest.mark.slow,
    pytest.mark.filterwarnings("ignore::FutureWarning"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.filterwarnings("ignore::UserWarning"),
]

START_TIMEOUT_S = 240.0
PROMPTS = [[10, 20, 30, 40], [5, 6, 7]]
SMALL_BUCKET = 96 << 10
"""About a tenth of each model: layers span buckets, so vLLM's reload keeps views of a bucket the
receiver is about to reuse (the worker copies those out)."""


@dataclasses.dataclass(frozen=True)
class Served:
    url: str
    kind: str
    checkpoint: Path


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    paths = {kind: tmp_path_factory.mktemp(kind) for kind in ("qwen2", "qwen3_moe")}
    for kind, path in paths.items():
        save_model(kind, path)
    return paths


@pytest.fixture(
    scope="module",
    params=[("qwen2", 1), ("qwen2", 2), ("qwen3_moe", 1), ("qwen3_moe", 2)],
    ids=["qwen2-tp1", "qwen2-tp2", "moe-tp1", "moe-tp2"],
)
def server(request: pytest.FixtureRequest, checkpoints: dict[str, Path]) -> Iterator[Served]:
    """Stock vLLM on dummy weights with the weightsync backend."""
    kind, tp = request.param
    with stock_vllm(checkpoints[kind], kind, tp) as served:
        yield served


@contextlib.contextmanager
def stock_vllm(checkpoint: Path, kind: str, tp: int, load_format: str = "dummy") -> Iterator[Served]:
    """Stock vLLM on `checkpoint` at tensor parallel size `tp` with the weightsync backend, started
    by docs/integrations/vllm.md's command as written. Once it stops, what it left in /dev/shm and
    the temporary folder (its message queues, its CPU all-reduce segments and their rendezvous
    files) is removed: only what its own processes made (tests/leftovers.py)."""
    port = free_port()
    env, command = doc_server_command(checkpoint, port)
    command[command.index("--load-format") + 1] = load_format
    command += ["--tensor-parallel-size", str(tp), "--distributed-executor-backend", "mp" if tp > 1 else "uni"]
    env = os.environ | env | {"VLLM_CPU_OMP_THREADS_BIND": "0|1" if tp > 1 else "auto"}
    footprints = Footprints()
    child = ChildProcess(command, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(url, child)
        footprints.during(child.pid)
        yield Served(url, kind, checkpoint)
    finally:
        footprints.during(child.pid)
        child.close()
        footprints.remove()


DOC = Path(__file__).resolve().parents[2] / "docs" / "integrations" / "vllm.md"


def doc_block(after: str, language: str) -> str:
    """The first `language` code block after the line containing `after` in the vLLM doc."""
    text = DOC.read_text().split(after, 1)[1]
    return text.split(f"```{language}\n", 1)[1].split("```\n", 1)[0]


def doc_server_command(model: Path, port: int) -> tuple[dict[str, str], list[str]]:
    """The doc's server command, as written, for `model` on `port`: its variables and its argv
    (`python` is this interpreter)."""
    words = shlex.split(doc_block("## The lines that change", "bash"))
    start = words.index("python")
    env = dict(word.split("=", 1) for word in words[:start])
    argv = words[start:]
    assert "MODEL_DIR" in argv and "8000" in argv, argv
    argv = [sys.executable, *argv[1:]]
    return env, [str(model) if word == "MODEL_DIR" else str(port) if word == "8000" else word for word in argv]


def test_the_docs_trainer_program_runs_as_written(server, tmp_path, monkeypatch, capsys) -> None:
    """docs/integrations/vllm.md's trainer, a whole program, against the doc's own server command
    (the fixture runs it): three pushes, each committed on every worker and labelled."""
    if server.kind != "qwen2":
        pytest.skip("the doc's program trains a dense model")
    program = tmp_path / "train_vllm.py"
    program.write_text(doc_block("The trainer, written with vLLM's own classes", "python"))
    monkeypatch.setattr(sys, "argv", [str(program), str(server.checkpoint), server.url])
    runpy.run_path(str(program), run_name="__main__")
    lines = capsys.readouterr().out.strip().splitlines()
    versions = [int(line.split(" committed on ")[0].removeprefix("version ")) for line in lines]
    assert len(versions) == 3 and versions == list(range(versions[0], versions[0] + 3)), lines
    assert all(re.match(r"version \d+ committed on (\d+) of \1 receivers \(full\): ", line) for line in lines), lines
    assert _label(server.url) == str(versions[-1])


def test_the_docs_moe_program_runs_as_written(server, tmp_path, monkeypatch, capsys) -> None:
    """docs/integrations/vllm.md's MoE program ("## Mixture-of-experts models"), against the doc's
    own server command: the checkpoint's tensors, one per expert, committed on every worker."""
    if server.kind != "qwen3_moe":
        pytest.skip("the doc's program pushes a MoE")
    program = write_program("docs/integrations/vllm.md", "## Mixture-of-experts models", tmp_path / "push_moe.py")
    monkeypatch.setattr(sys, "argv", [str(program), str(server.checkpoint), server.url])
    runpy.run_path(str(program), run_name="__main__")
    [line] = capsys.readouterr().out.strip().splitlines()
    assert re.match(r"version \d+ committed on (\d+) of \1 receivers \(full\): ", line), line
    assert _label(server.url) == line.split()[1]


def test_the_readme_server_command_is_the_docs() -> None:
    """The README's command (under "## vLLM's own weight-transfer API") is this doc's, which the
    `server` fixture runs as written."""
    readme = snippet("README.md", "## vLLM's own weight-transfer API")
    assert readme.text == snippet("docs/integrations/vllm.md", "## The lines that change").text


def _wait_healthy(url: str, child: ChildProcess) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        assert child.alive(), "vLLM exited before it served"
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise AssertionError(f"vLLM did not serve within {START_TIMEOUT_S} s")


@pytest.fixture(scope="module")
def trainer_models(checkpoints: dict[str, Path]) -> dict[str, torch.nn.Module]:
    from transformers import AutoModelForCausalLM

    return {kind: AutoModelForCausalLM.from_pretrained(path).eval() for kind, path in checkpoints.items()}


@pytest.fixture
def trainer_model(server: Served, trainer_models: dict[str, torch.nn.Module]) -> torch.nn.Module:
    return trainer_models[server.kind]


def _source(kind: str, model: torch.nn.Module) -> VLLMWeightSource:
    """What a trainer hands vLLM's trainer API: the dense model's parameters as they are; the
    MoE's in its checkpoint's names, one tensor per expert (transformers 5 holds stacks)."""
    return ModuleSource(model) if kind == "qwen2" else VLLMSource(HFCheckpointSource(model))


def _checkpoint_digest(served: Served, source: VLLMWeightSource) -> str:
    """The content digest of the checkpoint's own tensors, in the order `source` sends them."""
    from safetensors.torch import load_file

    written = load_file(served.checkpoint / "model.safetensors")
    names = [meta.name for meta in source.metadata()]
    assert sorted(names) == sorted(written)
    return source_digest([(name, written[name]) for name in names])


def _engine(url: str, source: object, transport: str = "shm", bucket_bytes: int | str = "auto", **more: object):  # type: ignore[no-untyped-def]
    options = SenderOptions(**{"verify": "full", "timeout": 20, "bucket_bytes": bucket_bytes} | more)  # type: ignore[arg-type]
    return WeightTransferTrainerFactory.trainer_init(
        WeightsyncTrainerInitInfo(rank=0, transport=transport, options=options),
        client=HTTPVLLMWeightSyncClient(url, timeout=120),
        source=source,
    )


def _label(url: str) -> str:
    return str(httpx.get(f"{url}/weight_info", timeout=10).json()["weight_version"])


def _rpc(url: str, method: str, *args: object) -> None:
    """vLLM's dev route: `method` on every worker."""
    body = {"method": method, "args": list(args), "timeout": 120}
    httpx.post(f"{url}/collective_rpc", json=body, timeout=130).raise_for_status()


def _checksums(url: str) -> dict[str, str]:
    """vLLM's own per-parameter checksums of what every worker serves."""
    answer = httpx.post(f"{url}/weight_checker", json={"action": "checksum"}, timeout=60)
    answer.raise_for_status()
    return dict(answer.json()["checksums"])


def _greedy(url: str, prompt: list[int]) -> list[int]:
    body = {"prompt": prompt, "max_tokens": 8, "temperature": 0, "return_token_ids": True}
    answer = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
    answer.raise_for_status()
    return list(answer.json()["choices"][0]["token_ids"])


def _reference(model: torch.nn.Module, prompt: list[int]) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False)  # type: ignore[operator]
    return [int(token) for token in out[0, len(prompt) :]]


class _Listed(VLLMWeightSource):
    """A vLLM `WeightSource` over given pairs (a trainer whose export is wrong)."""

    def __init__(self, pairs: list[tuple[str, torch.Tensor]]) -> None:
        self.pairs = pairs

    def metadata(self) -> list[ParamMeta]:
        return [ParamMeta(name, tensor.dtype, tuple(tensor.shape)) for name, tensor in self.pairs]

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        return iter(self.pairs)


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_stock_vllm_takes_pushes_bit_exact_through_its_own_api(server, trainer_model, transport) -> None:
    source = _source(server.kind, trainer_model)
    engine = _engine(server.url, source, transport, bucket_bytes=SMALL_BUCKET)
    try:
        httpx.post(f"{server.url}/pause", params={"mode": "wait"}, timeout=30).raise_for_status()
        report = engine.send_weights()
        httpx.post(f"{server.url}/resume", timeout=30).raise_for_status()
        assert report is not None and report.ok, report
        assert len(report.outcomes) == len(engine.workers) >= 1
        assert report.content_digest == _checkpoint_digest(server, source)
        assert _label(server.url) == "1"
        for prompt in PROMPTS:
            assert _greedy(server.url, prompt) == _reference(trainer_model, prompt)
    finally:
        engine.shutdown()
    _served_equals_vllms_own_load(server, source)


def _served_equals_vllms_own_load(server: Served, source: VLLMWeightSource) -> None:
    """What every worker serves after the push in small buckets equals vLLM's own reload of the
    checkpoint, and a push of the whole model in one bucket (vLLM's per-parameter checksums).

    vLLM 0.32's own reload leaves CPU MoE experts unpacked (the backend packs them after its
    reload: internals.prepack_cpu_experts), so for those the reference is the one-bucket push,
    which must change them back from what the reload left."""
    pushed = _checksums(server.url)
    _rpc(server.url, "update_config", {"load_config": {"load_format": "auto"}})
    _rpc(server.url, "reload_weights")
    reloaded = _checksums(server.url)
    assert pushed.keys() == reloaded.keys()
    differ = {name for name in pushed if pushed[name] != reloaded[name]}
    experts = {name for name in pushed if ".experts." in name}
    assert differ <= experts, sorted(differ - experts)
    assert bool(differ) == (server.kind == "qwen3_moe"), "vLLM's reload packs CPU experts now: drop the exception"
    engine = _engine(server.url, source, bucket_bytes=16 << 20)
    try:
        httpx.post(f"{server.url}/pause", params={"mode": "wait"}, timeout=30).raise_for_status()
        report = engine.send_weights(version=2)
        httpx.post(f"{server.url}/resume", timeout=30).raise_for_status()
        assert report is not None and report.ok, report
    finally:
        engine.shutdown()
    assert _checksums(server.url) == pushed


def test_delta_pushes_through_vllms_own_api_land_as_patches_bit_exact(server, trainer_model) -> None:
    """With `delta`, the trainer API's workers land in a standby copy (docs/delta.md): after a full
    push, sparse changes travel as patches to every worker, each commit verified against the
    content digest, and vLLM serves what transformers generates from the changed model."""
    model = copy.deepcopy(trainer_model)
    source = _source(server.kind, model)
    engine = _engine(server.url, source, "tcp", delta=True)
    try:
        first = engine.send_weights()
        assert first is not None and first.ok and {o.mode for o in first.outcomes} == {"full"}, first
        for step in range(2):
            with torch.no_grad():
                for parameter in model.parameters():
                    flat = parameter.view(-1)
                    flat[step::97] += 0.01  # about 1% of the elements
            report = engine.send_weights()
            assert report is not None and report.ok, report
            assert {o.mode for o in report.outcomes} == {"delta"}, report.summary()
            assert report.wire_bytes < first.wire_bytes / 4, (report.wire_bytes, first.wire_bytes)
            assert report.content_digest == source_digest(list(source)), report
        assert _label(server.url) == str(engine.version)
        for prompt in PROMPTS:
            assert _greedy(server.url, prompt) == _reference(model, prompt)
    finally:
        engine.shutdown()


def test_bad_plans_fail_loudly_and_label_nothing(server, trainer_model) -> None:
    pairs = list(_source(server.kind, trainer_model))
    twice = pairs[:-1] + [pairs[0]]  # one tensor twice, the last missing: the same element count
    bad = [(_Listed(twice), "twice"), (_Listed([]), "plan lacks")]
    if server.kind == "qwen3_moe":  # the stacks as transformers 5 holds them
        bad.append((ModuleSource(trainer_model), "unknown tensor 'model.layers.0.mlp.experts.gate_up_proj'"))
    engine = _engine(server.url, bad[0][0])
    try:
        httpx.post(f"{server.url}/pause", params={"mode": "wait"}, timeout=30).raise_for_status()
        for version, (source, why) in enumerate(bad, start=7):
            engine.source = source
            with pytest.raises(SyncFailed, match=why):
                engine.send_weights(version=version)
            assert _label(server.url) != str(version)
        engine.source = _Listed(pairs)  # the update window opens again after a failed round
        report = engine.send_weights(version=20)
        httpx.post(f"{server.url}/resume", timeout=30).raise_for_status()
        assert report is not None and report.ok
        assert _label(server.url) == "20"
        assert _greedy(server.url, PROMPTS[0]) == _reference(trainer_model, PROMPTS[0])
    finally:
        engine.shutdown()


def test_a_push_outside_the_update_window_is_refused(server, trainer_model) -> None:
    source = _source(server.kind, trainer_model)
    engine = _engine(server.url, source)
    try:
        addresses = [worker.address for worker in engine.workers]
        with WeightSender(addresses, timeout=20, raise_on_failure=False) as sender:
            report = sender.push(list(source), version=50)
        assert not report.ok
        assert all("no weight update is open" in (outcome.error or "") for outcome in report.failed)
    finally:
        engine.shutdown()


REFUSAL_TIMEOUT_S = 30.0
"""The sender's timeout, and so every worker's, in the refusal test: a round that waited for it
could not end within `PROMPTLY_S`."""
PROMPTLY_S = 10.0


class _Unreadable:
    """A trainer's source (vLLM's API) that fails before any push can plan it."""

    def metadata(self) -> list[object]:
        raise ValueError("the trainer's index of its weights is unreadable")

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        raise AssertionError("never walked")


@pytest.mark.parametrize("refusal", ["token", "plan", "source"])
def test_a_refused_round_fails_at_once_and_the_next_round_is_labelled(server, trainer_model, refusal) -> None:
    source = _source(server.kind, trainer_model)
    engine = _engine(server.url, source, timeout=REFUSAL_TIMEOUT_S)
    httpx.post(f"{server.url}/pause", params={"mode": "wait"}, timeout=30).raise_for_status()
    try:
        report = engine.send_weights(version=30)
        assert report is not None and report.ok, report
        served = _checksums(server.url)
        other = [(name, tensor + 1) for name, tensor in source]  # weights that would show if they landed
        if refusal == "token":  # the workers hold no token: they do not take a trainer with one
            engine.shutdown()
            engine = _engine(server.url, _Listed(other), timeout=REFUSAL_TIMEOUT_S, auth_token="t" * 32)
        elif refusal == "plan":  # refused by every worker's receiver, before vLLM's loader sees it
            engine.source = _Listed(other[:-1] + [other[0]])
        else:  # the push fails before its offer: the sender tells every worker it gave up
            engine.source = _Unreadable()
        started = time.monotonic()
        with pytest.raises(ValueError if refusal == "source" else SyncFailed) as failed:
            engine.send_weights(version=31)
        assert time.monotonic() - started < PROMPTLY_S, "the round waited for the workers' timeout"
        message = str(failed.value)
        if refusal != "source":
            assert "\n" not in message and any(worker.address in message for worker in engine.workers), message
        expected = {"token": "AuthError", "plan": "PlanError: plan names a tensor twice", "source": "unreadable"}
        assert expected[refusal] in message
        assert _label(server.url) == "30"
        assert _checksums(server.url) == served, "a refused round changed what the workers serve"

        if refusal == "token":  # a trainer started again, with the workers' (no) token
            engine.shutdown()
            engine = _engine(server.url, source, timeout=REFUSAL_TIMEOUT_S)
            next_version: int | None = 31
        else:  # the same trainer: its next version is still 31
            engine.source = source
            next_version = None
        started = time.monotonic()
        report = engine.send_weights(next_version)  # every worker left the refused round: it starts at once
        assert time.monotonic() - started < PROMPTLY_S
        assert report is not None and report.ok and report.version == 31, report
        assert report.content_digest == _checkpoint_digest(server, source)
        assert _label(server.url) == "31"
        assert _checksums(server.url) == served  # the same weights again, pushed whole
    finally:
        httpx.post(f"{server.url}/resume", timeout=30).raise_for_status()
        engine.shutdown()


@pytest.mark.parametrize("fault", FAULTS)
@pytest.mark.parametrize("server", [("qwen2", 1)], ids=["qwen2-tp1"], indirect=True)
def test_the_same_fault_gives_the_same_documented_outcome(server: Served, fault: str) -> None:
    """tests/integrations/test_one_round.py's rule on vLLM, on this module's TP=1 server (last: the
    faults leave it as the rule says, and the recovering push gives it the checkpoint again)."""
    from safetensors.torch import load_file

    with Target("vllm", server.url).connected() as target:
        _the_rule_holds(target, load_file(server.checkpoint / "model.safetensors"), fault)
