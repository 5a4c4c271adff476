"""What a user's W&B run and the probe's W&B values look like, per way of logging (issue 35).

Run as a script (``python tests/wandb_usages.py OUT_DIR usage:mode ...``) it trains for
:data:`UPDATES` updates with a probe snapshotting every update and a user logging in one of
:data:`USAGES`, all in real offline W&B runs, reads every run back from its ``.wandb`` file and
prints one ``RESULT {json}`` line per item. ``mode``: ``none`` (no probe: the reference),
``separate`` (the default: a W&B run of the probe's own) or ``join`` (``separate_run=False``).
``pair:N`` runs N attempts of two probes (two models) on one user run with a user thread.
``tests/sinks/test_wandb_contract.py`` runs it in a subprocess (bounded; W&B's process-wide
state stays out of pytest); run against another checkout it measures that code.
"""

from __future__ import annotations

import json
import math
import os
import re
import sys
import threading
import time
import warnings
from pathlib import Path

UPDATES = 50
USAGES = ("step", "plain", "split", "some_step", "thread", "trainer")
#: the keys the user logs (the Trainer's: those of every logging step)
USER_KEYS = ("loss", "lr", "eval", "gpu", "train/loss", "train/grad_norm", "train/learning_rate", "train/epoch",
             "train/global_step")
LOST = re.compile(r"(\d+) of the probe's (\d+) snapshots did not reach")
MAYBE = re.compile(r"; (\d+) more may not have")


def probe_run_id(user_run_id: str, prefix: str = "attn_probe") -> str:
    """The id of the probe's own run beside ``user_run_id`` (the code's own rule where it has one)."""
    try:
        from attn_probe.sinks.wandb import probe_run_id as rule
    except ImportError:  # a checkout from before issue 35
        return f"{user_run_id}-{prefix}"
    return rule(user_run_id, prefix)


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


def probe_rows(history: list[dict], prefix: str = "attn_probe") -> dict[int, dict]:
    """``{probe step: {attn_probe key: value}}`` of the rows holding ``<prefix>/step``."""
    got: dict[int, dict] = {}
    for row in history:
        if f"{prefix}/step" in row:
            step = int(row[f"{prefix}/step"])
            assert step not in got, f"probe step {step} in two rows"
            got[step] = {"attn_probe" + k[len(prefix):]: v for k, v in row.items()
                         if k.startswith(f"{prefix}/") and k != f"{prefix}/step"}
    return got


def wrong_values(got: dict[int, dict], want: dict[int, dict]) -> list[int]:
    return [s for s in got if s not in want or sorted(got[s]) != sorted(want[s])
            or not all(same(got[s][k], v) for k, v in want[s].items())]


def user_view(history: list[dict]) -> dict:
    """The user's own rows (their keys and ``_step``) and each user key's series in row order."""
    rows = []
    for row in history:
        mine = {k: v for k, v in row.items() if k in USER_KEYS}
        if mine:
            rows.append({**mine, "_step": row["_step"]})
    series = {k: [r[k] for r in rows if k in r] for k in USER_KEYS}
    return {"rows": rows, "series": {k: v for k, v in series.items() if v}}


def told(caught: list) -> dict:
    text = [str(w.message) for w in caught if "attn_probe" in str(w.message)]
    lost = maybe = 0
    for t in text:
        m = LOST.search(t)
        if m:
            lost = int(m.group(1))
            m2 = MAYBE.search(t)
            maybe = int(m2.group(1)) if m2 else 0
    return {"warnings": text, "told_lost": lost, "told_maybe": maybe}


def user_loop(run, usage: str, model, opt, steps: int) -> None:
    """``steps`` updates of ``model``; the user logs after each in the way ``usage`` says."""

    wb_step = 0  # the user's own count of W&B rows (some_step)
    stop = threading.Event()
    background = None
    if usage == "thread":
        def beat() -> None:
            for i in range(200):
                run.log({"gpu": i})
                time.sleep(0.002)
        background = threading.Thread(target=beat, daemon=True)
        background.start()
    for k in range(1, steps + 1):
        fake_gradients(model, k)
        loss = 1.0 / k
        if usage == "split":
            run.log({"loss": loss}, step=k, commit=False)
        opt.step()  # the probe's snapshot
        opt.zero_grad()
        if usage == "step":
            run.log({"loss": loss}, step=k)
        elif usage in ("plain", "thread"):
            run.log({"loss": loss})
        elif usage == "split":
            run.log({"lr": 0.1 / k}, commit=True)
        elif usage == "some_step":
            if k % 5 == 0:  # step= on these updates only, ahead of W&B's own count
                run.log({"loss": loss, "eval": float(k)}, step=wb_step + 2, commit=True)
                wb_step += 3
            else:
                run.log({"loss": loss})
                wb_step += 1
    stop.set()
    if background is not None:
        background.join(60)


def fake_gradients(model, k: int) -> None:
    """Seeded gradients (cheaper than a backward pass): the weights move at every update."""
    import torch

    g = torch.Generator().manual_seed(k)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=g) * 0.05


def one_usage(usage: str, mode: str, out: Path, steps: int = UPDATES) -> dict:
    import torch
    import wandb
    from tracker_servers import expected_metrics, tiny_bert

    import attn_probe
    from attn_probe.sinks.wandb import WandbSink

    root = out / f"{usage}-{mode}"
    root.mkdir(parents=True)
    if usage == "trainer":
        return trainer_usage(mode, root, out, steps)
    run = wandb.init(project="attn-probe-contract", dir=str(root), mode="offline", name=f"user-{usage}", group="g35")
    model = tiny_bert(0, layers=1, hidden=16, heads=2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sink = None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        t0 = time.monotonic()
        if mode == "none":
            user_loop(run, usage, model, opt, steps)
        else:
            sink = WandbSink(run) if mode == "separate" else WandbSink(run, separate_run=False)
            probe = attn_probe.watch(model, optimizer=opt, log_dir=str(root / "probe"), every=1, sinks=[sink])
            user_loop(run, usage, model, opt, steps)
            probe.close()
        seconds = time.monotonic() - t0
        run.finish()
    result = {"usage": usage, "mode": mode, "seconds": round(seconds, 2), **user_view(run_file_history(out, run.id)),
              **told(caught)}
    if mode == "none":
        return result
    want = expected_metrics(probe.log_dir)
    history = run_file_history(out, probe_run_id(run.id)) if mode == "separate" else run_file_history(out, run.id)
    got = probe_rows(history)
    result.update(snapshots=sorted(want), reached=sorted(got), wrong_values=wrong_values(got, want),
                  probe_keys_in_user_run=any(k.startswith("attn_probe") for r in run_file_history(out, run.id) for k in r))
    if getattr(sink, "joined", None) is not None:
        result.update(lost=sink.joined.lost, maybe_lost=sink.joined.maybe_lost)
    if mode == "separate":
        result["probe_run_group"] = run_group(out, probe_run_id(run.id))
    return result


def trainer_usage(mode: str, root: Path, out: Path, steps: int) -> dict:
    import wandb
    from helpers import RandomTokens, make_args, tiny_bert
    from tracker_servers import expected_metrics
    from transformers import Trainer

    import attn_probe

    args = make_args(root / "out", steps, report_to=["wandb"], logging_steps=3)
    trainer = Trainer(model=tiny_bert(), args=args, train_dataset=RandomTokens())
    if mode != "none":
        try:
            attn_probe.attach(trainer, every=1, wandb_separate_run=(mode == "separate"))
        except TypeError:  # a checkout from before issue 35: its only way
            trainer.callback_handler.callbacks = [cb for cb in trainer.callback_handler.callbacks
                                                  if type(cb).__name__ != "AttnProbeCallback"]
            attn_probe.attach(trainer, every=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        t0 = time.monotonic()
        trainer.train()
        seconds = time.monotonic() - t0
    run_id = wandb.run.id
    wandb.run.finish()
    history = run_file_history(out, run_id)
    log_history = [{**{f"train/{k}": v for k, v in row.items() if f"train/{k}" in USER_KEYS},
                    "train/global_step": row["step"]} for row in trainer.state.log_history if "loss" in row]
    result = {"usage": "trainer", "mode": mode, "seconds": round(seconds, 2), **user_view(history), **told(caught),
              "log_history": log_history}
    if mode == "none":
        return result
    runs = [d for d in (root / "out" / "runs").iterdir() if (d / "attn_probe.jsonl").is_file()]
    want = expected_metrics(runs[0])
    got = probe_rows(run_file_history(out, probe_run_id(run_id)) if mode == "separate" else history)
    result.update(snapshots=sorted(want), reached=sorted(got), wrong_values=wrong_values(got, want),
                  probe_keys_in_user_run=any(k.startswith("attn_probe") for r in history for k in r))
    if mode == "separate":
        result["probe_run_group"] = run_group(out, probe_run_id(run_id))
    return result


def pair_attempt(i: int, out: Path, steps: int = 10) -> dict:
    """Two probes (two models, one WandbSink each) on one user run, a user thread logging, the main
    thread logging with ``step=``: separate runs on even attempts, joining on odd ones. Bounded."""
    import torch
    import wandb
    from tracker_servers import expected_metrics, tiny_bert

    import attn_probe
    from attn_probe.sinks.wandb import WandbSink

    mode = "separate" if i % 2 == 0 else "join"
    root = out / f"pair{i}"
    root.mkdir(parents=True)
    run = wandb.init(project="attn-probe-pair", dir=str(root), mode="offline", name=f"pair{i}", group="pairs")
    models = [tiny_bert(s, layers=1, hidden=16, heads=2) for s in (0, 1)]
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in models]
    box: dict = {}

    def train() -> None:
        sinks = [WandbSink(run, separate_run=(mode == "separate")) for _ in models]
        probes = [attn_probe.watch(m, optimizer=o, log_dir=str(root / f"probe{j}"), every=1, sinks=[s])
                  for j, (m, o, s) in enumerate(zip(models, opts, sinks, strict=True))]
        beat_stop = threading.Event()

        def beat() -> None:
            n = 0
            while not beat_stop.is_set():
                run.log({"gpu": n})
                n += 1
                time.sleep(0.001)
        user = threading.Thread(target=beat, daemon=True)
        user.start()
        for k in range(1, steps + 1):
            for m, o in zip(models, opts, strict=True):
                fake_gradients(m, k)
                o.step()
            run.log({"loss": 1.0 / k}, step=10_000 + k)  # above any row the thread made
        beat_stop.set()
        user.join(10)
        for p in probes:
            p.close()
        box["dirs"] = [p.log_dir for p in probes]

    t0 = time.monotonic()
    worker = threading.Thread(target=train, daemon=True)
    worker.start()
    worker.join(10)
    seconds = time.monotonic() - t0
    if worker.is_alive():
        return {"attempt": i, "mode": mode, "hung": True, "seconds": round(seconds, 2)}
    run.finish()
    user_history = run_file_history(out, run.id)
    result = {"attempt": i, "mode": mode, "hung": False, "seconds": round(seconds, 2), "probes": []}
    for prefix, log_dir in zip(("attn_probe", "attn_probe_2"), box["dirs"], strict=True):
        history = run_file_history(out, probe_run_id(run.id, prefix)) if mode == "separate" else user_history
        got = probe_rows(history, "attn_probe" if mode == "separate" else prefix)
        want = expected_metrics(log_dir)
        result["probes"].append({"reached": sorted(got), "wrong_values": wrong_values(got, want),
                                 "snapshots": sorted(want)})
    return result


def run_group(root: Path, run_id: str) -> str:
    from tracker_servers import wandb_records

    path = next(p for p in root.rglob(f"run-{run_id}.wandb") if "latest-run" not in p.parts)
    return next(r.run.run_group for r in wandb_records(path) if r.WhichOneof("record_type") == "run")


def main(argv: list[str]) -> None:
    import torch
    import wandb

    torch.set_num_threads(1)  # tiny models: more threads only contend

    out = Path(argv[0])
    out.mkdir(parents=True, exist_ok=True)
    # one W&B service for every run (W&B reads these once per process); every run is found under out
    os.environ.update(WANDB_MODE="offline", WANDB_DIR=str(out), WANDB_PROJECT="attn-probe-contract",
                      WANDB_LOG_MODEL="false", WANDB_WATCH="false", WANDB_RUN_GROUP="g35")
    try:
        for arg in argv[1:]:
            name, _, what = arg.partition(":")
            if name == "pair":
                for i in range(int(what)):
                    result = pair_attempt(i, out)
                    print("RESULT " + json.dumps({"item": f"pair{i}", **result}), flush=True)
                continue
            result = one_usage(name, what, out)
            print("RESULT " + json.dumps({"item": arg, **result}), flush=True)
    finally:
        wandb.teardown()


if __name__ == "__main__":
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path.insert(0, here)
    main(sys.argv[1:])
