"""Alert and warning lines never share a terminal line with a progress bar.

A tqdm bar is drawn with ``\\r`` and no newline; text written while it shows lands after it
(``39/60 [01:04<00:37, 1.77s/it]attn_probe alert at step 40: ...``). The captured stream is
rendered as a terminal shows it (``\\r`` returns to column 0 and later text overwrites), and the
probe's lines must start at column 0 of a line of their own.
"""

from __future__ import annotations

import math
import subprocess
import sys
import textwrap

import torch
from helpers import REPO, RandomTokens, make_args, tiny_bert
from transformers import Trainer, TrainerCallback

import attn_probe
from attn_probe.live.alerts import AlertRule


def rendered_lines(stream: str) -> list[str]:
    """The lines a terminal shows for ``stream``: per line, ``\\r`` moves to column 0 and the
    characters after it overwrite what was there."""
    shown = []
    for raw in stream.split("\n"):
        cells: list[str] = []
        column = 0
        for char in raw:
            if char == "\r":
                column = 0
                continue
            if column < len(cells):
                cells[column] = char
            else:
                cells.append(char)
            column += 1
        shown.append("".join(cells).rstrip())
    return shown


class PoisonQueries(TrainerCallback):
    """After step ``at``, NaN query weights: the next snapshot's spectral norms are NaN (an alert)."""

    def __init__(self, at: int):
        self.at = at

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if state.global_step == self.at:
            with torch.no_grad():
                for layer in model.bert.encoder.layer:
                    layer.attention.self.query.weight.fill_(math.nan)


def test_an_alert_under_the_trainers_progress_bar_starts_its_own_line(tmp_path, capsys):
    # the probe is first in the callbacks: its alert at step 3 is printed while the bar shows 2/6
    probe_cb = attn_probe.AttnProbeCallback(every=1, log_dir=str(tmp_path / "tb"), metrics=["spectral_norm"],
                                            alerts=[AlertRule("spectral_norm", above=1e6)])
    trainer = Trainer(model=tiny_bert(), args=make_args(tmp_path, 6, disable_tqdm=False, logging_steps=100),
                      train_dataset=RandomTokens(), callbacks=[probe_cb, PoisonQueries(at=2)])
    trainer.train()
    err = capsys.readouterr().err
    assert "it/s]" in err or "s/it]" in err  # the Trainer's bar was drawn on this stream
    alerts = [line for line in rendered_lines(err) if "attn_probe alert at step" in line]
    assert len(alerts) == 2, alerts  # one per layer, at step 3 (NaN fires once per layer)
    for line in alerts:
        assert line.startswith("attn_probe alert at step 3: spectral_norm = nan in self layer "), line


SCRIPT = textwrap.dedent("""
    import sys, warnings
    from tqdm.auto import tqdm
    from attn_probe.isolation import print_line, safe_warn

    warnings.simplefilter("{action}")
    bar = tqdm(total=10, file=sys.stderr, mininterval=0, ncols=60)
    bar.update(4)
    safe_warn("attn_probe: a warning while the bar shows")
    print_line("attn_probe alert at step 4: a line while the bar shows")
    bar.update(1)
    bar.close()
""")


def test_warnings_and_lines_under_a_tqdm_bar_start_their_own_lines():
    for action in ("default", "error"):  # under -W error the warning is printed by safe_warn itself
        done = subprocess.run([sys.executable, "-c", SCRIPT.format(action=action)], capture_output=True,
                              text=True, timeout=120, cwd=REPO, check=True)
        shown = rendered_lines(done.stderr)
        warning = [line for line in shown if "a warning while the bar shows" in line]
        alert = [line for line in shown if "a line while the bar shows" in line]
        assert len(warning) == 1 and len(alert) == 1, shown
        if action == "default":  # warnings.showwarning's form: WHERE:LINE: RuntimeWarning: message
            assert warning[0].endswith(": RuntimeWarning: attn_probe: a warning while the bar shows"), shown
            assert "%|" not in warning[0] and "it/s]" not in warning[0], shown
        else:
            assert warning[0] == "RuntimeWarning: attn_probe: a warning while the bar shows", shown
        assert alert[0] == "attn_probe alert at step 4: a line while the bar shows", shown
        assert any(line.startswith(" 50%|") for line in shown), shown  # the bar was redrawn and went on
