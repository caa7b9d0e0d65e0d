"""What a demo run leaves behind: steps.jsonl as it goes, then a plot and a short summary."""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

__all__ = ["StepLog", "event_marks", "plot", "summary", "title"]


class StepLog:
    """steps.jsonl: one JSON object per training step, flushed as each step ends."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.records: list[dict[str, Any]] = []
        self._file = path.open("w", encoding="utf-8")

    def write(self, record: dict[str, Any]) -> None:
        self.records.append(record)
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


EVENT_COLORS = {
    "killed": "tab:red",
    "died": "tab:red",
    "stopped": "tab:red",
    "failed": "tab:red",
    "restarted": "tab:orange",
}
"""Colour of an event's line by its verb; anything else (a server rejoining) is green."""


def plot(records: list[dict[str, Any]], path: Path, *, engine: str = "", mode: str = "") -> None:
    """Mean reward, weight-sync milliseconds and bytes on the wire per step, one PNG. The title
    names the mode, the engine and the model's size; a server killed, restarted or rejoining is a
    labelled line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in records]
    figure, (reward_axis, sync_axis, bytes_axis) = plt.subplots(3, 1, sharex=True, figsize=(7, 6.5))
    reward_axis.plot(steps, [r["reward_mean"] for r in records], color="tab:green")
    reward_axis.set_ylabel("mean reward")
    reward_axis.set_ylim(0, 1.05)
    sync_axis.plot(steps, [r["sync_seconds"] * 1e3 for r in records], color="tab:blue")
    sync_axis.set_ylabel("weight sync (ms)")
    # a delta push moves only what changed; records from before delta sync carry no wire_bytes
    wire = [r.get("wire_bytes", r["sync_bytes"]) / 1024 for r in records]
    bytes_axis.plot(steps, wire, color="tab:purple", label="on the wire")
    bytes_axis.plot(steps, [r["sync_bytes"] / 1024 for r in records], color="tab:gray", linestyle=":", label="pushed")
    patched = [(r["step"], r["wire_bytes"] / 1024) for r in records if "delta" in r.get("sync_modes", ())]
    if patched:  # the syncs that carried a patch (delta), at their bytes on the wire
        bytes_axis.scatter(*zip(*patched, strict=True), color="tab:purple", s=9, label=f"delta sync ({len(patched)})")
    if any("model_bytes" in r and r["model_bytes"] != r["sync_bytes"] for r in records):  # an adapter is pushed
        model = [r.get("model_bytes", r["sync_bytes"]) / 1024 for r in records]
        bytes_axis.plot(steps, model, color="black", linestyle="--", linewidth=0.8, label="the whole model")
    bytes_axis.set_ylabel("KiB per sync")
    bytes_axis.set_ylim(bottom=0)
    bytes_axis.legend(fontsize=7, loc="lower right")
    bytes_axis.set_xlabel("training step")
    counts: dict[int, int] = {}
    for step, label, color in event_marks(records):
        for axis in (reward_axis, sync_axis, bytes_axis):
            axis.axvline(step, color=color, linestyle="--", linewidth=1)
        row = counts[step] = counts.get(step, -1) + 1
        box = {"facecolor": "white", "alpha": 0.8, "edgecolor": "none", "pad": 1}
        reward_axis.text(step, 1.0 - 0.12 * row, f" {label}", color=color, fontsize=7, va="top", bbox=box)
    figure.suptitle(title(records, engine, mode), fontsize=9)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


def title(records: list[dict[str, Any]], engine: str, mode: str) -> str:
    """The plot's title, on two lines (one would not fit the figure): the mode and the engine,
    then what each step pushes: the whole model, or a LoRA adapter (the records say which)."""
    payload = records[0]["sync_bytes"] if records else 0
    setup = ", ".join(part for part in (mode, f"{engine} engine" if engine else "") if part)
    adapter = bool(records and records[0].get("adapter"))
    what = f"{payload / 1024:.0f} KiB {'LoRA adapter' if adapter else 'model'}"
    return f"weightsync demo: GRPO{f' ({setup})' if setup else ''}\n{what} pushed after every step"


def event_marks(records: list[dict[str, Any]]) -> list[tuple[int, str, str]]:
    """(step, label, colour) of every event: a server killed or failing, restarted, rejoining."""
    marks = []
    for record in records:
        for event in record["events"]:
            color = next((c for verb, c in EVENT_COLORS.items() if verb in event), "tab:green")
            marks.append((record["step"], event.split(";")[0], color))
    return marks


def summary(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Reward over the first and last 10% of steps, syncs done, mean sync GB/s, bytes per sync
    (against the whole model's: less under an adapter), max lag."""
    tenth = max(1, len(records) // 10)
    mean = lambda rows: sum(r["reward_mean"] for r in rows) / len(rows)  # noqa: E731
    seconds = sum(r["sync_seconds"] for r in records)
    pushed = statistics.median(r["sync_bytes"] for r in records)
    model = records[0].get("model_bytes", records[0]["sync_bytes"])
    wire = statistics.median(r.get("wire_bytes", r["sync_bytes"]) for r in records)
    return {
        "reward_first_step": records[0]["reward_mean"],
        "steps": len(records),
        "reward_first_10pct": mean(records[:tenth]),
        "reward_last_10pct": mean(records[-tenth:]),
        "syncs": len(records) + 1,  # the initial push, then one per step
        "mean_sync_gbps": sum(r["sync_bytes"] for r in records) / seconds / 1e9 if seconds else 0.0,
        "mean_sync_seconds": seconds / len(records),
        "median_sync_bytes": pushed,
        "median_wire_bytes": wire,
        "model_bytes": model,
        "median_sync_fraction": pushed / model if model else 0.0,
        "median_wire_fraction": wire / model if model else 0.0,
        "pushes": "LoRA adapter" if records[0].get("adapter") else "whole model",
        "max_version_lag": max(r["max_version_lag"] for r in records),
        "dropped_stale": sum(r["dropped_stale"] for r in records),
        "events": [f"step {r['step']}: {e}" for r in records for e in r["events"]],
    }
