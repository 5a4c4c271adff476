"""Stage 1: is this step due, and (on a sharded run) do all ranks agree to snapshot it.

One question, :meth:`StepDecision.due`: ``Due(scores, images)`` from the snapshot schedule and
the image schedule. A snapshot is taken at a step newer than the last one taken. On a sharded
run (FSDP, DTensor, ZeRO-3 on several ranks) the ranks first agree, in one MIN all-reduce on
the probe's gloo group (:meth:`StepDecision.agree`, protocol in ``docs/distributed.md``), so
that every rank enters the same gathers or none does.
"""

from __future__ import annotations

from datetime import timedelta
from typing import NamedTuple

from torch import nn

from ...distributed import Agreement, AgreementError, sharding_kind, world_info
from ...isolation import safe_warn
from ..schedules import Schedule, is_deterministic

__all__ = ["Due", "StepDecision", "make_agreement"]


class Due(NamedTuple):
    """What fires at a step: the snapshot schedule (``scores``), the image schedule (``images``)."""

    scores: bool
    images: bool

    def any(self) -> bool:
        return self.scores or self.images


def make_agreement(model: nn.Module, timeout: float | None) -> Agreement | None:
    """On a sharded run, the gloo group of the probe's agreements (made at attach on every rank:
    a collective); ``None`` for a single process, DDP and ZeRO-1/2, which issue no collective."""
    if not world_info().distributed or sharding_kind(model) == "local":
        return None
    return Agreement(timeout)


class StepDecision:
    """The step decision: schedules, the last snapshot's step, the agreement between ranks.

    ``disabled`` is set after a failed agreement: this rank then issues no further collective.
    ``timeout``: how long the ranks wait for each other in the probe's agreements (that of
    ``agreement``'s group; the probe sets it for its own group on DDP), named in the warning.
    """

    def __init__(self, schedule: Schedule | None, image_schedule: Schedule | None,
                 agreement: Agreement | None) -> None:
        self.schedule = schedule
        self.image_schedule = image_schedule
        self.agreement = agreement
        self.last_step: int | None = None
        self.disabled = False
        self.timeout: timedelta | None = agreement.timeout if agreement is not None else None
        #: the built-in schedules answer the same on every rank: a "no" needs no agreement
        self.deterministic = is_deterministic(schedule) and is_deterministic(image_schedule)

    def due(self, step: int) -> Due:
        """Which schedules fire at ``step`` (may raise: a schedule is user code)."""
        return Due(self.schedule is not None and bool(self.schedule(step)),
                   self.image_schedule is not None and bool(self.image_schedule(step)))

    def measures_forwards(self, step: int) -> bool:
        """Whether ``step``'s forward passes are measured (the attention stage's ``due``): the
        snapshot schedule fires there and the probe is not disabled (may raise: user code)."""
        return not self.disabled and self.due(step).scores

    def final_due(self, step: int) -> bool:
        """Whether ``close()`` takes a final snapshot at ``step``: not disabled, and ``step`` is
        newer than the last snapshot; sharded: always, the agreement skips a stale step everywhere."""
        return not self.disabled and (self.fresh(step) or self.agreement is not None)

    def fresh(self, step: int) -> bool:
        """Whether ``step`` is newer than the last snapshot's (steps must increase)."""
        return self.last_step is None or step > self.last_step

    def taken(self, step: int) -> None:
        """Record that a snapshot is taken at ``step``."""
        self.last_step = step

    def needs_vote(self, due: Due | None, error: BaseException | None) -> bool:
        """Whether a counted step must be agreed on (sharded): a "no" of a deterministic schedule
        is the same on every rank and skips the agreement."""
        return error is not None or due is None or due.any() or not self.deterministic

    def agree(self, step: int, want: bool, error: BaseException | None) -> bool:
        """Sharded: one agreement decides, identically on every rank, whether to snapshot ``step``.

        Rank 0's ``want`` decides; an ``error`` on any rank (its schedule raised), a stale step
        on any rank, or different steps make every rank skip. The vote is a MIN all-reduce: the
        steps' maximum is taken as the MIN of their negations (``-max(s) = min(-s)``), so that
        one collective yields both ends of the range. Raises (after the collective) on an error
        or disagreement; returns ``False`` to skip, also after a failed agreement, which
        disables the probe on this rank (warned); ``True``: the step is recorded as taken.
        """
        assert self.agreement is not None
        try:
            rank0 = self.agreement.rank == 0
            vote = [(1 if want else 0) if rank0 else 1, 0 if error is not None else 1,
                    1 if self.fresh(step) else 0, int(step), -int(step)]
        except Exception as exc:  # noqa: BLE001 - still vote: "no"
            vote, error = [1, 0, 1, 0, 0], exc
        try:
            due, ok, fresh_everywhere, low, minus_high = self.agreement.min(vote)
        except AgreementError as exc:
            self.disable(str(exc))
            return False
        if not ok:
            if error is not None:
                raise error
            raise RuntimeError(f"the schedule failed on another rank at step {step}; every rank skips it")
        if low != -minus_high:
            raise RuntimeError(f"the ranks disagree on the step ({low} to {-minus_high}); every rank skips it")
        if due and fresh_everywhere:
            self.taken(step)
            return True
        return False

    def agree_counted(self, step: int, error: BaseException | None) -> Due | None:
        """Sharded, at a counted step: what is due there if every rank agreed to snapshot it
        (:meth:`agree`), else ``None``. A schedule that raises counts as "no", agreed with the
        other ranks; a "no" that needs no vote (:meth:`needs_vote`) issues no collective.
        ``error``: the step could not be read on this rank."""
        due = None
        if error is None:
            try:
                due = self.due(step)
            except Exception as exc:  # noqa: BLE001 - counts as "no", agreed with the other ranks
                error = exc
        if not self.needs_vote(due, error) or not self.agree(step, due is not None and due.any(), error):
            return None
        return due

    def disable(self, reason: str) -> None:
        """A failed agreement: issue no further collective from this rank (warned once)."""
        self.disabled = True
        after = f" (after the agreement timeout, {self.timeout.total_seconds():g} s)" if self.timeout else ""
        safe_warn(
            f"attn_probe: an agreement between ranks failed on this rank ({reason}); the probe is disabled "
            f"here and issues no further collective. The other ranks time out in their next agreement{after} "
            "and disable theirs too. Training continues; no further snapshots are taken in this run."
        )

    def close(self) -> None:
        """Close the agreement group (local: its sockets and threads)."""
        if self.agreement is not None:
            self.agreement.close()
