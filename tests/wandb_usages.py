"""How many of the probe's snapshots reach a user's W&B run, per way of logging (issue 29).

Run as a script (``python tests/wandb_usages.py OUT_DIR [usage[@steps] ...]``) it trains a tiny BERT
for ``STEPS`` updates with ``watch(every=EVERY)`` and a ``WandbSink`` in an offline W&B run, the
user logging every ``USER_EVERY`` updates in one of the ways below, reads each run back from its
``.wandb`` file and prints one ``RESULT {json}`` line per usage: the probe steps that reached W&B
(and their values compared with ``attn_probe.jsonl``), the user's logs found, the warnings.
``tests/sinks/test_wandb_rows.py`` runs it in a subprocess (bounded, and W&B's process-wide state
stays out of pytest); run against another checkout it measures that code.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
import warnings
from pathlib import Path

STEPS, EVERY, USER_EVERY = 500, 10, 100
USAGES = ("plain", "step", "split", "split_step", "separate", "separate_split")


def run_file_history(root: Path, run_id: str, timeout: float = 60.0) -> list[dict]:
    """History rows of offline W&B run ``run_id`` under ``root``, once its ``exit`` record is written."""
    from tracker_servers import wandb_records

    deadline = time.monotonic() + timeout
    while True:
        files = [p for p in root.rglob(f"run-{run_id}.wandb") if "latest-run" not in p.parts]
        records = []
        if len(files) == 1:
            try:
                records = wandb_records(files[0])
            except Exception:  # noqa: BLE001 - still being written
                records = []
        if records and records[-1].WhichOneof("record_type") == "exit":
            break
        if time.monotonic() > deadline:
            raise AssertionError(f"no finished run file for {run_id} under {root}: {files}")
        time.sleep(0.1)
    return [{item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in r.history.item}
            for r in records if r.WhichOneof("record_type") == "history"]


def same(a: float, b: float) -> bool:
    return (math.isnan(a) and math.isnan(b)) or math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-9)


def one_usage(usage: str, out: Path, steps: int = STEPS) -> dict:
    import torch
    import wandb
    from tracker_servers import SEQ, VOCAB, expected_metrics, tiny_bert

    import attn_probe
    from attn_probe.sinks.wandb import WandbSink

    root = out / usage
    root.mkdir(parents=True)
    run = wandb.init(project="attn-probe-rows", dir=str(root), mode="offline", name=f"user-{usage}", group="g29")
    explicit = usage in ("step", "split_step", "separate", "separate_split")
    split = usage in ("split", "split_step", "separate_split")
    sink = WandbSink(run, separate_run=True) if usage.startswith("separate") else WandbSink(run)
    model = tiny_bert(0, layers=1, hidden=16, heads=2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    logged: list[tuple[int, str, float]] = []
    rows_wanted: list[dict] = []

    def log(data: dict, step: int, commit: bool | None = None) -> None:
        for k, v in data.items():
            logged.append((step, k, v))
        if explicit:
            run.log(data, step=step)
        else:
            run.log(data, commit=commit)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        probe = attn_probe.watch(model, optimizer=opt, log_dir=str(root / "probe"), every=EVERY, sinks=[sink])
        for i in range(steps):
            if i % EVERY == 0:  # the weights move between snapshots; no forward/backward otherwise (speed)
                ids = torch.randint(0, VOCAB, (4, SEQ), generator=torch.Generator().manual_seed(i))
                model(input_ids=ids, labels=ids).loss.backward()
            user = (i + 1) % USER_EVERY == 0
            if user:
                first = {"loss": 1.0 / (i + 1), "user_step": i + 1}
                log(first, i + 1, commit=False if split else None)
            opt.step()  # the probe's snapshot (every EVERY updates)
            opt.zero_grad()
            if user and split:
                second = {"lr": 0.1 / (i + 1)}
                log(second, i + 1)
                rows_wanted.append({**first, **second})
            elif user:
                rows_wanted.append(first)
        probe.close()
        run.finish()
    history = run_file_history(root, run.id)
    groups = [run_group(root, run.id)]
    probe_history = history
    if usage.startswith("separate"):
        probe_id = sink_run_id(root, run.id)
        probe_history = run_file_history(root, probe_id)
        groups.append(run_group(root, probe_id))
    want = expected_metrics(probe.log_dir)
    got: dict[int, dict] = {}
    for row in probe_history:
        if "attn_probe/step" in row:
            step = int(row["attn_probe/step"])
            assert step not in got, f"probe step {step} in two rows"
            got[step] = {k: v for k, v in row.items() if k.startswith("attn_probe/") and k != "attn_probe/step"}
    wrong = [s for s in got if s not in want or sorted(got[s]) != sorted(want[s])
             or not all(same(got[s][k], v) for k, v in want[s].items())]
    user_rows = [{k: v for k, v in row.items() if k in ("loss", "user_step", "lr")} for row in history]
    user_rows = [r for r in user_rows if r]
    user_steps = {int(row["_step"]) for row in history if "user_step" in row and row.get("_step") == row["user_step"]}
    return {"usage": usage, "snapshots": len(want), "reached": sorted(got), "wrong_values": wrong,
            "user_rows_wanted": rows_wanted, "user_rows_found": user_rows,
            "user_rows_at_their_step": len(user_steps), "groups": groups,
            "probe_keys_in_user_run": any(k.startswith("attn_probe/") for row in history for k in row),
            "warnings": [str(w.message) for w in caught if "attn_probe" in str(w.message)]}


def run_group(root: Path, run_id: str) -> str:
    from tracker_servers import wandb_records

    path = next(p for p in root.rglob(f"run-{run_id}.wandb") if "latest-run" not in p.parts)
    return next(r.run.run_group for r in wandb_records(path) if r.WhichOneof("record_type") == "run")


def sink_run_id(root: Path, user_id: str) -> str:
    ids = {p.stem[len("run-"):] for p in root.rglob("run-*.wandb") if "latest-run" not in p.parts}
    others = sorted(ids - {user_id})
    assert len(others) == 1, (user_id, ids)
    return others[0]


def main(argv: list[str]) -> None:
    import wandb

    out = Path(argv[0])
    for arg in argv[1:] or USAGES:  # "usage" or "usage@steps"
        usage, _, steps = arg.partition("@")
        try:
            result = one_usage(usage, out, int(steps or STEPS))
        except TypeError as exc:  # an older WandbSink without separate_run
            result = {"usage": usage, "error": f"{type(exc).__name__}: {exc}"}
        finally:
            wandb.teardown()
        print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    main(sys.argv[1:])
