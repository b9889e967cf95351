"""The gateway process (egemma.gateway.app) as the launcher runs it: in its own process group (its workers
with it), restarted when it dies, stopped after Triton has drained."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

from egemma.ops.procfs import end_group, wait_up


class Front:
    """`python -m egemma.gateway.app *args`, answering HTTP on url once start() returns."""

    def __init__(self, args: list[str], url: str, log=lambda msg: print(f"gateway: {msg}", file=sys.stderr,
                                                                       flush=True)):
        self.args, self.url, self.log = args, url, log
        self.proc: subprocess.Popen | None = None
        self._next_try = 0.0

    def start(self, timeout: float = 60.0) -> "Front":
        self.proc = subprocess.Popen([sys.executable, "-m", "egemma.gateway.app", *self.args,
                                      f"--exit-with-parent={os.getpid()}"], start_new_session=True)
        wait_up(self.proc, self.answers, timeout, f"the gateway on {self.url}",
                f"python -m egemma.gateway.app {' '.join(self.args)}", self.kill)
        return self

    def answers(self) -> bool:
        """Any HTTP answer (the probe path is a 404) means the gateway serves."""
        try:
            urllib.request.urlopen(f"{self.url}/gateway-probe", timeout=2).close()
        except urllib.error.HTTPError:
            return True
        except OSError:
            return False
        return True

    def check(self):
        """Restart the gateway if it died (at most every 2 s when restarts fail)."""
        if self.proc.poll() is None or time.monotonic() < self._next_try:
            return
        self.log(f"the gateway exited with {self.proc.returncode}; restarting it")
        self.kill()
        self._next_try = time.monotonic() + 2.0
        try:
            self.start()
        except (RuntimeError, TimeoutError) as e:
            self.log(f"restart failed: {e}")

    def kill(self, sig=signal.SIGKILL, timeout: float = 10.0):
        """Signal the whole process group and wait until none of it is left (SIGKILL after timeout: once the
        parent is gone, its workers get no more time)."""
        if left := end_group(self.proc, sig, timeout, timeout):
            self.log(f"processes {left} of the gateway's group outlived SIGKILL for {timeout:g}s")

    def stop(self, timeout: float = 15.0):
        """SIGTERM: each worker stops accepting, finishes its requests in flight, exits."""
        if self.proc is not None:
            self.kill(signal.SIGTERM, timeout)
