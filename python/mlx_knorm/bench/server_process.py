"""A server command run as a process on a free loopback port, for the
benchmarks (bench/commands.py, bench/server_memory.py) and the tests that
talk to a real server: started and waited for (``/health``), asked over
HTTP, measured from /proc, stopped by its pid."""

from __future__ import annotations

import json
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """``command`` (a server command line without ``--port``) on a free
    loopback port, its output in ``log_path``; ``stop()`` ends it."""

    def __init__(self, command: list, log_path: Path, env: dict | None = None,
                 start_timeout_s: float = 120, request_timeout_s: float = 120, poll_s: float = 0.2):
        self.port = free_port()
        self.log_path = Path(log_path)
        self.request_timeout_s = request_timeout_s
        self.log = open(self.log_path, "w")
        self.process = subprocess.Popen([str(c) for c in command] + ["--port", str(self.port)],
                                        stdout=self.log, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + start_timeout_s
        while True:
            if self.process.poll() is not None:
                self.log.close()
                raise RuntimeError(f"the server exited:\n{self.log_path.read_text()}")
            try:
                if self.get("/health")[0] == 200:
                    break
            except OSError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the server did not start in {start_timeout_s} s:\n{self.log_path.read_text()}")
            time.sleep(poll_s)

    def log_text(self) -> str:
        self.log.flush()
        return self.log_path.read_text()

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def get(self, path: str) -> tuple[int, object]:
        with urllib.request.urlopen(self.url(path), timeout=self.request_timeout_s) as response:
            return response.status, json.loads(response.read())

    def post(self, path: str, body) -> tuple[int, bytes]:
        """``body`` (bytes as they are, anything else as JSON) to ``path``:
        the status and the answer's bytes, an HTTP error's too."""
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        request = urllib.request.Request(self.url(path), data=data, headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=self.request_timeout_s) as response:
                return response.status, response.read()
        except urllib.error.HTTPError as e:
            return e.code, e.read()

    def faults(self) -> int:
        """The process's minor page faults so far (/proc/PID/stat field 10)."""
        return int(Path(f"/proc/{self.process.pid}/stat").read_text().rsplit(")", 1)[1].split()[7])

    def rss(self) -> int:
        """The process's resident set in bytes (/proc/PID/status VmRSS)."""
        with open(f"/proc/{self.process.pid}/status") as status:
            return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmRSS:"))

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.log.close()
