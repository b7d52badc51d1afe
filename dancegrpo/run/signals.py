"""Stopping on request: SIGTERM (what a cluster scheduler sends before it kills), SIGINT, and
the death of the torchrun launcher.

A signal only sets a flag; the loop polls it after each step (`StopRequest.pending`, agreed
over ranks), saves a checkpoint and raises `Interrupted`. A second SIGINT interrupts at once.
Workers under torchrun watch their parent: when the launcher dies (SIGKILL leaves them
orphaned, still training and writing checkpoints) they stop the same way, and leave
unconditionally after GRACE_S if the step cannot finish.
"""
import os
import signal
import threading
import time

from ..errors import say
from ..utils.communications import all_reduce_max

GRACE_S = 120.0  # after the launcher's death, the longest a worker waits for its step to finish
# The launcher's death reaches no worker as a signal (SIGKILL, a crash): it is recorded as SIGHUP, the
# shell's "controlling process gone" (exit 129), and said as what happened, not as a signal received.
LAUNCHER_GONE = signal.SIGHUP
NAMES = {signal.SIGTERM: "SIGTERM", signal.SIGINT: "SIGINT", LAUNCHER_GONE: "the launcher's end"}


class StopRequest:
    def __init__(self):
        self.signum = None
        self._previous = {}
        self._watcher = None

    def install(self, watch_parent=False):
        if threading.current_thread() is not threading.main_thread():
            return self  # signal handlers can only be set from the main thread (e.g. under a test runner)
        for sig in (signal.SIGTERM, signal.SIGINT):
            self._previous[sig] = signal.signal(sig, self._on_signal)
        if watch_parent:
            self._watcher = threading.Thread(target=self._watch_parent, args=(os.getppid(),), daemon=True)
            self._watcher.start()
        return self

    def uninstall(self):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}

    def _on_signal(self, signum, frame):
        if self.signum is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt  # a second Ctrl-C: stop now
        self.signum = signum
        say(f"\n{NAMES.get(signum, signum)} received: finishing this step, then saving a checkpoint and "
            "stopping (Ctrl-C again to stop at once)")

    def _watch_parent(self, parent):
        while os.getppid() == parent:
            time.sleep(0.5)
        say(f"rank pid {os.getpid()}: the launcher (pid {parent}) is gone; stopping after this step")
        self.signum = LAUNCHER_GONE
        time.sleep(GRACE_S)
        say(f"pid {os.getpid()}: step did not finish within {GRACE_S:.0f} s of the launcher's death; exiting")
        os._exit(1)

    def pending(self, device):
        """The signal number when any rank was asked to stop, else 0 (collective under torchrun)."""
        return int(all_reduce_max(0.0 if self.signum is None else float(self.signum), device))


def signal_name(signum):
    return NAMES.get(signum, str(signum))
