"""`weightsync.serving.footprint`: what a server process tree made is removed at close, and only
that; a dead server's leftovers are reaped by the folder it left. No engine: a child process
makes segments and files the way vLLM's do."""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import textwrap
from multiprocessing import shared_memory
from pathlib import Path

from weightsync.serving.footprint import FOLDER_PREFIX, MANIFEST, reap_dead

SRC = str(Path(__file__).resolve().parents[2] / "src")

# A server (this script) whose child makes what vLLM makes: a multiprocessing segment it maps, a
# rendezvous file in $TMPDIR, an all-reduce segment named after it that nobody maps any more, and
# a socket in $TMPDIR. The child is still running at close: close must end it first.
SERVER = textwrap.dedent(
    """
    import json, logging, subprocess, sys, time
    from weightsync.serving.footprint import Footprint
    logging.basicConfig(level="INFO")
    CHILD = '''
    import os, socket, sys, tempfile, time
    from multiprocessing import shared_memory, resource_tracker
    segment = shared_memory.SharedMemory(create=True, size=4096)
    resource_tracker.unregister(segment._name, "shared_memory")  # as if the tracker were killed too
    tmp = tempfile.gettempdir()
    name = "vllm_dist_" + "ab" * 16
    open(os.path.join(tmp, name), "w").close()
    open("/dev/shm/" + name + "-tp:0-[0-1]-cpushm_0", "w").close()
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(os.path.join(tmp, "engine.sock"))
    print(segment.name, tmp, flush=True)
    time.sleep(600)
    '''
    footprint = Footprint()
    child = subprocess.Popen([sys.executable, "-c", CHILD], stdout=subprocess.PIPE, text=True)
    segment, tmp = child.stdout.readline().split()
    footprint.note()
    removed = footprint.close()
    print(json.dumps({"segment": segment, "folder": tmp, "removed": removed, "child": child.poll()}))
    """
)


def test_close_ends_the_tree_and_removes_what_it_made_and_nothing_else() -> None:
    # a short folder, not tmp_path (longer under pytest-xdist): the child binds a Unix socket in
    # the server's folder inside it, and such a path may have at most 107 bytes
    tmp_path = Path(tempfile.mkdtemp(prefix="fp-"))
    foreign = shared_memory.SharedMemory(create=True, size=4096)  # another run's: must stay
    try:
        done = subprocess.run(
            [sys.executable, "-c", SERVER],
            capture_output=True,
            text=True,
            timeout=60,
            env=os.environ | {"PYTHONPATH": SRC, "TMPDIR": str(tmp_path)},
        )
        assert done.returncode == 0, done.stderr
        result = json.loads(done.stdout)
        assert result["child"] is not None  # ended before anything was removed
        allreduce = "vllm_dist_" + "ab" * 16 + "-tp:0-[0-1]-cpushm_0"
        assert sorted(result["removed"]) == sorted([result["segment"], allreduce])
        assert "removed 2 shared-memory segments the engine left: " in done.stderr, done.stderr  # any engine's
        assert not Path("/dev/shm", result["segment"]).exists() and not Path("/dev/shm", allreduce).exists()
        assert Path(result["folder"]).parent == tmp_path and not Path(result["folder"]).exists()
        assert list(tmp_path.iterdir()) == []
        assert Path("/dev/shm", foreign.name).exists()
    finally:
        foreign.close()
        foreign.unlink()
        shutil.rmtree(tmp_path, ignore_errors=True)


def test_a_dead_servers_leftovers_are_reaped_and_a_live_ones_are_not(tmp_path: Path) -> None:
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    segments = {}
    for pid in (gone.pid, os.getpid()):  # a dead server's, and a live one's (this process)
        folder = tmp_path / f"{FOLDER_PREFIX}{pid}-{secrets.token_hex(4)}"
        folder.mkdir()
        segments[pid] = f"psm_{secrets.token_hex(4)}"
        Path("/dev/shm", segments[pid]).touch()
        (folder / MANIFEST).write_text(segments[pid] + "\n")
    try:
        assert reap_dead(str(tmp_path)) == [segments[gone.pid]]
        assert not Path("/dev/shm", segments[gone.pid]).exists()
        assert Path("/dev/shm", segments[os.getpid()]).exists()
        assert [folder.name.split("-")[2] for folder in tmp_path.iterdir()] == [str(os.getpid())]
    finally:
        for name in segments.values():
            Path("/dev/shm", name).unlink(missing_ok=True)


# A server (this script) whose engine process holds a semaphore of multiprocessing's spawn context
# and a shared-memory segment, as vLLM's processes do: registered with the resource tracker (the
# server's child), left in /dev/shm as sem.mp-* and psm_* until the tracker unlinks them. Killed
# first, the tracker never did; the segment, which the server unlinks itself, it called leaked.
TRACKED = textwrap.dedent(
    """
    import multiprocessing, os, sys, time
    from multiprocessing import shared_memory
    from pathlib import Path
    from weightsync.serving.footprint import Footprint

    def hold(path):
        lock = multiprocessing.get_context("spawn").Lock()
        segment = shared_memory.SharedMemory(create=True, size=4096)
        Path(path).write_text(lock._semlock.name + " " + segment.name)
        time.sleep(600)

    if __name__ == "__main__":
        footprint = Footprint()
        engine = multiprocessing.get_context("spawn").Process(target=hold, args=(sys.argv[1],), daemon=True)
        engine.start()
        while not os.path.exists(sys.argv[1]) or not Path(sys.argv[1]).read_text():
            time.sleep(0.05)
        footprint.note()
        footprint.close()
        os._exit(0)
    """
)


def test_close_lets_the_resource_tracker_unlink_what_killed_processes_registered(tmp_path: Path) -> None:
    script, named = tmp_path / "server.py", tmp_path / "semaphore"
    script.write_text(TRACKED)
    done = subprocess.run(
        [sys.executable, str(script), str(named)],
        capture_output=True,
        text=True,
        timeout=120,
        env=os.environ | {"PYTHONPATH": SRC, "TMPDIR": str(tmp_path)},
    )
    assert done.returncode == 0, done.stderr
    semaphore, segment = named.read_text().split()
    name = "sem." + semaphore.lstrip("/")
    assert name.startswith("sem.mp-") and not (Path("/dev/shm") / name).exists(), (name, done.stderr)
    assert not (Path("/dev/shm") / segment).exists() and "leaked shared_memory" not in done.stderr, done.stderr
