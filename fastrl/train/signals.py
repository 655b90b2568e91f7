"""SIGINT / SIGTERM while a run trains: during the RL steps the first signal lets the current step
finish, saves a checkpoint of it and stops the run (`Interrupted`, every rank at the same step);
a second one, or one before the first RL step, aborts at once (`Aborted`, a KeyboardInterrupt)."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Callable

import torch

from .common import all_ranks

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
"""Signals that stop a run after the current step, with a checkpoint."""

REPEAT_WINDOW_S = 1.0
"""A second stop signal within this many seconds of the first is the same interrupt delivered
twice (the terminal and torchrun both forward Ctrl-C), not a request to abort."""


class Interrupted(Exception):
    """SIGINT / SIGTERM stopped the run after finishing step `step`, which is saved in
    `checkpoint` (None on ranks other than 0). `exit_code` is 128 + the signal number (130 for
    SIGINT, 143 for SIGTERM), what `fastrl train` exits with."""

    def __init__(self, signum: int, step: int, checkpoint: str | None):
        self.signum, self.step, self.checkpoint = signum, step, checkpoint
        self.exit_code = 128 + signum
        super().__init__(
            f"{signal.Signals(signum).name}: stopped after step {step} (checkpoint {checkpoint})"
        )


class Aborted(KeyboardInterrupt):
    """A stop signal that could not wait for the step to finish: a second one, or one before
    the first RL step (warm-up, setup, step-0 eval). Nothing more is saved; `exit_code` is
    128 + the signal number."""

    def __init__(self, signum: int, where: str):
        self.signum, self.exit_code, self.where = signum, 128 + signum, where
        super().__init__(f"{signal.Signals(signum).name} {where}")


class StopSignals:
    """The stop signals of one `train` call. `installed()` puts the handlers in place (main
    thread only; the previous ones come back afterwards); `in_loop` says whether a signal may
    wait for the step to finish (`current_step()`: the steps finished so far); `finishing`,
    that the steps have ended and only curves.png is being written: a first signal then waits
    for it (the run ends as it would have), a second aborts; `requested()` is the signal any
    rank received (0: none), the same answer on every rank."""

    def __init__(self, rank: int, current_step: Callable[[], int]):
        self.rank, self.current_step = rank, current_step
        self.in_loop = self.finishing = False
        self.signum = self.time = None  # the first stop signal received, and when

    @contextlib.contextmanager
    def installed(self):
        self.signum = self.time = None
        self.in_loop = self.finishing = False
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {s: signal.signal(s, self._handle) for s in STOP_SIGNALS}
        try:
            yield
        finally:
            for s, h in previous.items():
                if h is not None:  # None: a handler not installed from Python; leave ours
                    signal.signal(s, h)

    def _handle(self, signum, frame) -> None:
        now = time.monotonic()
        if self.signum is not None and now - self.time < REPEAT_WINDOW_S:
            return  # the same interrupt, delivered twice
        if self.signum is not None or not (self.in_loop or self.finishing):
            where = "before the RL steps"
            if self.in_loop:
                where = f"in step {self.current_step() + 1}"
            elif self.finishing:
                where = f"after step {self.current_step()}, while writing curves.png"
            raise Aborted(signum, where)
        self.signum, self.time = signum, now
        if self.finishing:  # the steps are over: let the plot finish (a second signal aborts)
            if self.rank == 0:
                name = signal.Signals(signum).name
                note = "the RL steps are over, writing curves.png (send it again to abort)"
                os.write(2, f"\n{name} received: {note}\n".encode())
            return
        if self.rank == 0:  # os.write: never re-enters a Python stream being written
            again = "press Ctrl-C again" if signum == signal.SIGINT else "send it again"
            os.write(
                2,
                f"\n{signal.Signals(signum).name} received: finishing the current step, "
                f"then saving a checkpoint and stopping ({again} to abort at once)\n".encode(),
            )

    def requested(self, device: torch.device) -> int:
        """The stop signal received by any rank (0: none); every rank gets the same answer."""
        return int(all_ranks(self.signum or 0, torch.distributed.ReduceOp.MAX, device, torch.int64))
