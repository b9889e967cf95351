"""The gateway process (egemma.gateway.app) as the launcher runs it: in its own process group (its workers
with it), restarted when it dies, told first when the server stops (drain: readiness 503, its connections to
Triton's HTTP closed), stopped after Triton has drained."""
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
                                                                       flush=True), env: dict[str, str] | None = None):
        """env: variables the gateway gets beside this process's (the model's paths: TritonServer.path_env)."""
        self.args, self.url, self.log, self.env = args, url, log, env or {}
        self.proc: subprocess.Popen | None = None
        self._next_try = 0.0

    def start(self, timeout: float = 60.0, cancel=None) -> "Front":
        """launch() then wait()."""
        return self.launch().wait(timeout, cancel)

    def launch(self) -> "Front":
        """The process started; it answers HTTP a moment later (it needs Triton only for requests: the launcher
        starts it while Triton boots)."""
        self.proc = subprocess.Popen([sys.executable, "-m", "egemma.gateway.app", *self.args,
                                      f"--exit-with-parent={os.getpid()}"], start_new_session=True,
                                     env={**os.environ, **self.env})
        return self

    def wait(self, timeout: float = 60.0, cancel=None) -> "Front":
        """Until it answers. cancel: an event that, set meanwhile, ends the gateway (egemma.ops.procfs.Cancelled)."""
        wait_up(self.proc, self.answers, timeout, f"the gateway on {self.url}",
                f"python -m egemma.gateway.app {' '.join(self.args)}", self.kill, cancel=cancel)
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

    def kill(self, sig=signal.SIGKILL, timeout: float = 10.0, hurry=None):
        """Signal the whole process group and wait until none of it is left (SIGKILL after timeout, or once the
        event hurry is set: once the parent is gone, its workers get no more time)."""
        if left := end_group(self.proc, sig, timeout, timeout, hurry):
            self.log(f"processes {left} of the gateway's group outlived SIGKILL for {timeout:g}s")

    def drain(self):
        """SIGUSR1 to every worker: readiness answers 503, and the connections to Triton's HTTP close as soon as
        each is idle, so that Triton's stop does not wait for them."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGUSR1)

    def stop(self, timeout: float = 15.0, hurry=None):
        """SIGTERM: each worker stops accepting, finishes its requests in flight, exits."""
        if self.proc is not None:
            self.kill(signal.SIGTERM, timeout, hurry)
