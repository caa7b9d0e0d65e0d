"""LoRA adapters pushed in memory to a rollout server: served by name, pinned per request,
never stale, refused whole when they do not fit."""

from __future__ import annotations

import importlib.util
import re
import sys
import threading

import pytest
import torch
from safetensors.torch import load_file

from tests.helpers import ENGINES, WAIT_S, wait_until
from tests.models import EOS_ID
from tests.server.conftest import live_server
from weightsync import Adapter, SyncFailed, WeightSender, adapter_from_peft
from weightsync.errors import ServerError

pytest.importorskip("peft")

VLLM_LOG_LINE = re.compile(r"^(\(\w+ pid=\d+\) )?(DEBUG|INFO|WARNING|ERROR) \d\d-\d\d ")
"""A line of vLLM's own log ("(EngineCore pid=796) INFO 12-02 01:00:48 [...]")."""

PROMPT = [10, 20, 30, 40]


def peft_policy(model_dir, seed: int, rank: int = 4, targets=("q_proj", "v_proj")):  # type: ignore[no-untyped-def]
    """The checkpoint's model under a PEFT LoRA adapter with random (non-zero) weights."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=list(targets), init_lora_weights=False)
    model = get_peft_model(base, config).eval()
    for name, param in model.named_parameters():
        if "lora_B" in name:  # large enough that greedy output differs from the base model's
            param.data.mul_(20)
    return model


def greedy(model, prompt: list[int], max_tokens: int) -> list[int]:  # type: ignore[no-untyped-def]
    """What a server answers with greedy sampling: up to `max_tokens` tokens, through EOS."""
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        out = model.generate(input_ids=ids, max_new_tokens=max_tokens, do_sample=False, eos_token_id=None)
    tokens = out[0, len(prompt) :].tolist()
    return tokens[: tokens.index(EOS_ID) + 1] if EOS_ID in tokens else tokens


def on_base(policy, model_dir, base_tensors, adapter_tensors):  # type: ignore[no-untyped-def]
    """`policy`'s adapter on other base weights: what a server serves after a base push."""
    from peft import get_peft_model, set_peft_model_state_dict
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    base.load_state_dict(base_tensors, strict=False)  # strict=False: the tied lm_head is not in the checkpoint
    model = get_peft_model(base, policy.peft_config["default"]).eval()
    set_peft_model_state_dict(model, adapter_tensors)
    return model


@pytest.fixture(scope="module", params=ENGINES)
def server(request, tiny_models):  # type: ignore[no-untyped-def]
    """One server per engine for the module (vLLM takes half a minute to start), serving LoRA
    adapters up to rank 8, with the checkpoint pushed as version 1."""
    model_dir = tiny_models["qwen2"]
    with live_server(model_dir, engine=request.param, sync_mode="keep", max_lora_rank=8) as live:
        with WeightSender(live.addresses, raise_on_failure=True) as sender:
            sender.push(load_file(model_dir / "model.safetensors"), version=1)
        yield live


@pytest.fixture
def served(server, tiny_models):  # type: ignore[no-untyped-def]
    with WeightSender(server.addresses, verify="bucket", raise_on_failure=True) as sender:
        yield tiny_models["qwen2"], server, sender


def running(server) -> int:  # type: ignore[no-untyped-def]
    """Requests generating now: the hf engine's loop, or vLLM's own gauge."""
    if server.server is not None:
        return int(server.server.loop.num_running)
    found = re.search(r"^vllm:num_requests_running\{[^}]*\} ([0-9.e+]+)$", server.client.metrics(), re.MULTILINE)
    return int(float(found.group(1))) if found else 0


def test_an_adapter_push_is_served_under_its_name(served) -> None:
    model_dir, server, sender = served
    policy = peft_policy(model_dir, seed=1)
    tensors, adapter = adapter_from_peft(policy, "served-name")
    report = sender.push(tensors, version=7, adapter=adapter)
    assert report.ok and report.total_bytes == sum(t.numel() * 4 for t in tensors.values())

    out = server.client.completions(PROMPT, model="served-name", max_tokens=8, temperature=0)
    assert out["choices"][0]["token_ids"] == greedy(policy, PROMPT, 8)
    assert out["model"] == "served-name" and out["weight_version"] == 7 and out["base_version"] == 1
    base = server.client.completions(PROMPT, max_tokens=8, temperature=0)
    with policy.disable_adapter():
        assert base["choices"][0]["token_ids"] == greedy(policy, PROMPT, 8) != out["choices"][0]["token_ids"]
    assert base["weight_version"] == 1 and "base_version" not in base

    info = server.client.weight_info()
    entry = next(entry for entry in info["adapters"] if entry["name"] == "served-name")
    assert entry["version"] == 7 and entry["resident_versions"] == [7]
    assert entry["content_digest"] == report.content_digest != ""
    assert info["version"] == 1  # the base weights are as they were
    base_card, *adapter_cards = server.client.models()["data"]
    adapter_card = next(card for card in adapter_cards if card["id"] == "served-name")
    assert adapter_card["parent"] == base_card["id"]


def test_a_reused_name_and_version_never_serves_the_stale_adapter(served) -> None:
    model_dir, server, sender = served
    first, second = peft_policy(model_dir, seed=1), peft_policy(model_dir, seed=2)
    for policy in (first, second):  # the same name and the same version number, new weights
        tensors, adapter = adapter_from_peft(policy, "policy")
        assert sender.push(tensors, version=3, adapter=adapter).ok
        out = server.client.completions(PROMPT, model="policy", max_tokens=8, temperature=0)
        assert out["choices"][0]["token_ids"] == greedy(policy, PROMPT, 8)
    assert greedy(first, PROMPT, 8) != greedy(second, PROMPT, 8)


def test_a_mismatched_adapter_is_refused_and_the_previous_one_serves_on(served) -> None:
    model_dir, server, sender = served
    policy = peft_policy(model_dir, seed=1)
    tensors, adapter = adapter_from_peft(policy, "policy")
    assert sender.push(tensors, version=1, adapter=adapter).ok

    wrong_shape = {name: torch.cat([t, t], dim=-1) if "lora_A" in name else t for name, t in tensors.items()}
    big_tensors, big = adapter_from_peft(peft_policy(model_dir, seed=3, rank=16), "policy")
    unknown = {name.replace("q_proj", "x_proj"): t for name, t in tensors.items()}
    model_name = server.client.models()["data"][0]["id"]  # a request naming it gets the base model
    cases = [
        (tensors, Adapter(model_name, 4, 8.0, adapter.target_modules), "has the served model's own name"),
        (wrong_shape, adapter, "do not fit a layer"),
        (tensors, Adapter("policy", 2, 4.0, adapter.target_modules), "does not have rank 2"),
        (big_tensors, big, "outside this engine's 1..8"),
        (unknown, Adapter("policy", 4, 8.0, ("v_proj", "x_proj")), "has no linear layer"),
    ]
    for bad, spec, why in cases:
        with pytest.raises(SyncFailed, match=why):
            sender.push(bad, version=2, adapter=spec)
        out = server.client.completions(PROMPT, model="policy", max_tokens=8, temperature=0)
        assert out["choices"][0]["token_ids"] == greedy(policy, PROMPT, 8) and out["weight_version"] == 1
    assert server.client.weight_info()["state"] == "ready"


def test_a_request_in_flight_finishes_on_its_adapter_version(served) -> None:
    """Adapter pushes land while a long request runs; that request ends on the version it
    started with, even once that version is past the ones kept, and a request started after the
    pushes gets the newest."""
    model_dir, server, sender = served
    old, new = peft_policy(model_dir, seed=1), peft_policy(model_dir, seed=2)
    tensors, adapter = adapter_from_peft(old, "policy")
    sender.push(tensors, version=1, adapter=adapter)
    long_tokens = 200
    result: dict = {}

    def long_request() -> None:
        result.update(server.client.completions(PROMPT, model="policy", max_tokens=long_tokens, temperature=0))

    thread = threading.Thread(target=long_request, daemon=True)
    thread.start()
    assert wait_until(lambda: running(server) == 1)
    tensors, adapter = adapter_from_peft(new, "policy")
    for version in (2, 3):  # two newer versions: version 1 is past the 2 kept, and still in use
        assert sender.push(tensors, version=version, adapter=adapter).ok
    out = server.client.completions(PROMPT, model="policy", max_tokens=8, temperature=0)
    assert out["weight_version"] == 3 and out["choices"][0]["token_ids"] == greedy(new, PROMPT, 8)
    assert next(a for a in server.client.weight_info()["adapters"] if a["name"] == "policy")["resident_versions"] == [
        2,
        3,
    ]
    assert running(server) == 1, "the long request ended before the push: make it longer"
    thread.join(WAIT_S)
    (choice,) = result["choices"]
    assert choice["token_ids"] == greedy(old, PROMPT, long_tokens)
    ended = len(choice["token_ids"])
    assert result["weight_version"] == 1 and choice["weight_versions"] == [{"version": 1, "start": 0, "end": ended}]


def test_a_server_without_the_adapter_names_what_it_serves(served) -> None:
    model_dir, server, sender = served
    tensors, adapter = adapter_from_peft(peft_policy(model_dir, seed=3), "listed")
    assert sender.push(tensors, version=1, adapter=adapter).ok
    with pytest.raises(ServerError) as caught:
        server.client.completions(PROMPT, model="absent", max_tokens=2)
    assert caught.value.status == 404 and "absent" in str(caught.value)
    assert "'listed'" in str(caught.value), "the adapters served are named (vLLM's own names only the base model)"


@pytest.mark.parametrize("staged", [False, True])
def test_a_base_push_under_a_served_adapter_keeps_the_adapter(tiny_models, staged) -> None:
    """The base weights change under a resident adapter: the adapter serves on the new base."""
    model_dir = tiny_models["qwen2"]
    v1 = load_file(model_dir / "model.safetensors")
    v2 = {name: tensor * 1.25 for name, tensor in v1.items()}
    policy = peft_policy(model_dir, seed=1)
    tensors, adapter = adapter_from_peft(policy, "policy")
    with (
        live_server(model_dir, engine="hf", staged=staged, max_lora_rank=8) as server,
        WeightSender(server.address) as sender,
    ):
        assert sender.push(v1, version=1).ok and sender.push(tensors, version=1, adapter=adapter).ok
        assert sender.push(v2, version=2).ok
        out = server.client.completions(PROMPT, model="policy", max_tokens=8, temperature=0)
    on_v2 = on_base(policy, model_dir, v2, tensors)
    assert out["choices"][0]["token_ids"] == greedy(on_v2, PROMPT, 8) != greedy(policy, PROMPT, 8)
    assert out["weight_version"] == 1 and out["base_version"] == 2


def test_a_server_started_without_lora_refuses_adapters_and_says_how(tiny_models) -> None:
    model_dir = tiny_models["qwen2"]
    policy = peft_policy(model_dir, seed=1)
    tensors, adapter = adapter_from_peft(policy, "policy")
    with live_server(model_dir, engine="hf") as server, WeightSender(server.address, raise_on_failure=False) as sender:
        report = sender.push(tensors, version=1, adapter=adapter)
    assert not report.ok and "start it with --max-lora-rank N" in report.failed[0].error


def test_weightsync_push_pushes_a_peft_adapter_folder_served_by_its_name(served, tmp_path, capsys) -> None:
    """`weightsync push --model ADAPTER_DIR`: adapter_config.json makes it an adapter (not base
    weights), served under the folder's name, its next version by default; a rank the server
    does not take is refused in one line."""
    from weightsync import cli

    model_dir, server, _ = served
    policy = peft_policy(model_dir, seed=3)
    policy.save_pretrained(tmp_path / "cli-adapter")
    capsys.readouterr()
    argv = ["push", "--model", str(tmp_path / "cli-adapter"), "--to", server.url, "--timeout", "30"]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert out[-1].startswith("adapter 'cli-adapter' version 1: committed on 1 of 1 servers; "), out
    assert cli.main([*argv, "--adapter-name", "cli-adapter"]) == 0  # the next version of the same name
    assert "adapter 'cli-adapter' version 2: committed" in capsys.readouterr().out
    answer = server.client.completions(PROMPT, model="cli-adapter", max_tokens=8, temperature=0)
    assert answer["choices"][0]["token_ids"] == greedy(policy, PROMPT, 8) and answer["weight_version"] == 2

    peft_policy(model_dir, seed=4, rank=16).save_pretrained(tmp_path / "too-wide")  # the server takes rank <= 8
    capsys.readouterr()  # transformers' loading bar
    assert cli.main(["push", "--model", str(tmp_path / "too-wide"), "--to", server.url, "--timeout", "30"]) == 1
    out, err = capsys.readouterr()
    assert "refused" in out.strip().splitlines()[-1] and len(err.strip().splitlines()) == 1, (out, err)
    assert "rank 16" in err and "Traceback" not in err, err


def test_the_docs_cli_push_runs_as_written(served, tmp_path) -> None:
    """docs/lora.md's two commands, as written, on a PEFT folder at runs/adapter: the folder's name
    serves the first, --adapter-name and --version the second."""
    from tests.doc_snippets import run_shell, shell_script, snippet, weightsync_on_path

    model_dir, server, _ = served
    policy = peft_policy(model_dir, seed=5)
    policy.save_pretrained(tmp_path / "runs" / "adapter")
    script = shell_script(snippet("docs/lora.md", "### From the command line"), {"http://127.0.0.1:8000": server.url})
    done = run_shell(script, cwd=tmp_path, path=weightsync_on_path(tmp_path / "bin"), timeout=300)
    assert done.returncode == 0, (done.stdout[-2000:], done.stderr[-3000:])
    said = [line for line in done.stdout.splitlines() if line.startswith("adapter ")]
    assert said[0].startswith("adapter 'adapter' version 1: committed on 1 of 1 servers"), done.stdout
    assert said[1].startswith("adapter 'reviewer' version 7: committed on 1 of 1 servers"), done.stdout
    for name, version in (("adapter", 1), ("reviewer", 7)):
        answer = server.client.completions(PROMPT, model=name, max_tokens=8, temperature=0)
        assert answer["weight_version"] == version and answer["choices"][0]["token_ids"] == greedy(policy, PROMPT, 8)


def test_an_adapter_serves_on_after_the_base_weights_change(served) -> None:
    """vLLM drops every adapter a worker holds when the base weights are replaced: the next
    request loads it again from weightsync's memory. (Last in the module: the base changes.)"""
    model_dir, server, sender = served
    policy = peft_policy(model_dir, seed=4)
    tensors, adapter = adapter_from_peft(policy, "policy")
    assert sender.push(tensors, version=9, adapter=adapter).ok
    v2 = {name: tensor * 1.25 for name, tensor in load_file(model_dir / "model.safetensors").items()}
    assert sender.push(v2, version=2).ok
    out = server.client.completions(PROMPT, model="policy", max_tokens=8, temperature=0)
    assert out["choices"][0]["token_ids"] == greedy(on_base(policy, model_dir, v2, tensors), PROMPT, 8)
    assert (out["weight_version"], out["base_version"]) == (9, 2)


DOC_SERVERS = [
    0,
    pytest.param(
        1,
        marks=[
            pytest.mark.slow,
            pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed"),
        ],
    ),
]
"""The blocks of docs/lora.md's "## The server side": transformers, then vLLM."""


@pytest.mark.parametrize("server_block", DOC_SERVERS, ids=["hf", "vllm"])
def test_the_docs_trainer_program_runs_as_written(tiny_models, tmp_path, server_block: int) -> None:
    """docs/lora.md's trainer ("## The trainer side"), a whole program, against a server started
    with the doc's own command ("## The server side"): the base once, then three adapter versions,
    each committed; requests naming the adapter are served by its newest version."""
    from tests.doc_snippets import run_shell, shell_script, snippet, weightsync_on_path, write_program
    from tests.helpers import free_port

    program = write_program("docs/lora.md", "## The trainer side", tmp_path / "train_lora.py")
    model_dir, port = tiny_models["qwen2"], free_port()
    serve = shell_script(snippet("docs/lora.md", "## The server side", server_block), {"DIR": str(model_dir)})
    url = f"http://127.0.0.1:{port}"
    script = serve.replace("8000", str(port)) + " &\n"  # as written, in the background
    script += f"until curl -s {url}/health | grep -q 'waiting for weights'; do kill -0 %1; sleep 0.5; done\n"
    script += f'python "{program}" "{model_dir}" {url}\n'
    bin_dir = weightsync_on_path(tmp_path / "bin")
    (bin_dir / "python").write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    (bin_dir / "python").chmod(0o755)
    done = run_shell(script, cwd=tmp_path, path=bin_dir, timeout=600)
    assert done.returncode == 0, (done.stdout[-2000:], done.stderr[-3000:])
    # the program's lines: vLLM's server logs to the same stdout, its stop after the program's end
    lines = [line for line in done.stdout.strip().splitlines() if not VLLM_LOG_LINE.match(line)]
    assert [line.split(" committed on ")[0] for line in lines[-4:-1]] == ["version 1", "version 2", "version 3"], lines
    assert lines[-1] == "policy 3", lines
