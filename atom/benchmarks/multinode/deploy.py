"""A deployment of ``atom launch ... serve`` over the nodes of a cluster: commands, start, stop.

Every node runs one launcher with the same command line but its own ``--node-rank``::

    env GLOO_SOCKET_IFNAME=eth0 PYTHON -m atom.launch --nnodes N --node-rank R
        --nproc-per-node K --master-addr ADDR0 --master-port P --log-dir DIR [LAUNCH_ARGS]
        -- serve --host ADDR0 --port HTTP [SERVE_ARGS]

(``--host ADDR0``: the OpenAI server binds node 0's address, so clients on other hosts reach
it; only rank 0's front end serves, so the other nodes ignore it.) How a command reaches its
node is the *method*:

* ``netns``: :class:`LocalNode`, the command inside the node's network namespace on this
  machine (:mod:`atom.benchmarks.multinode.netns`); what is left running afterwards is read
  from the namespace itself;
* ``ssh``: :class:`SshNode`, ``ssh DEST 'cd WORKDIR && echo PID $$ && exec COMMAND'``: plain
  OpenSSH with ``BatchMode`` (keys, no prompts), the remote pid read from the first line, the
  stop sent as ``ssh DEST kill -TERM PID``. Not tested here (no hosts to ssh to);
* ``print``: only :func:`node_commands`, the exact command of each node, for SLURM or any
  other runner.

Stopping (:meth:`Deployment.stop`): SIGTERM to node 0's launcher, which stops its ranks and
tells the other launchers through the store (a requested stop: every launcher exits with
143); a launcher still there after the timeout gets SIGTERM itself, then SIGKILL.
"""

from __future__ import annotations

import logging
import os
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import httpx

from atom.benchmarks.multinode.cluster import ClusterSpec

logger = logging.getLogger(__name__)

# the rank contract and launcher markers a driver's own environment must not pass on
_DROPPED_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                "MASTER_PORT", "NODE_RANK", "NNODES", "ATOM_LAUNCHER_PID", "ATOM_ERROR_FILE",
                "ATOM_FRONT_END_FD", "TORCHELASTIC_USE_AGENT_STORE")
_HEALTH_POLL_S = 1.0
_LOG_TAIL_LINES = 30


@dataclass(frozen=True)
class NodeCommand:
    """What node ``node_rank`` runs: the launcher's argv and the variables set for it."""

    node_rank: int
    argv: tuple[str, ...]
    env: Mapping[str, str]  # on top of the node's own environment

    def shell(self) -> str:
        """One shell line (``env K=V ... argv``), as ``print`` shows it."""
        assignments = [f"{k}={v}" for k, v in sorted(self.env.items())]
        return shlex.join(["env", *assignments, *self.argv] if assignments else self.argv)


def node_commands(cluster: ClusterSpec, *, log_dir: Callable[[int], str],
                  serve_args: tuple[str, ...] = (), launch_args: tuple[str, ...] = (),
                  env: Mapping[str, str] | None = None) -> list[NodeCommand]:
    """Every node's launcher command (module docstring).

    Args:
        log_dir: node rank → the launcher's ``--log-dir`` on that node.
        serve_args: options after ``serve`` (engine and server options).
        launch_args: extra launcher options (e.g. ``--node-timeout-s 10``).
        env: variables for every node on top of ``cluster.env`` (e.g. ``OMP_NUM_THREADS``).
    Raises:
        ValueError: the cluster's addresses are unassigned.
    """
    python = cluster.python or sys.executable
    extra = {**cluster.env, **(env or {})}
    if cluster.gloo_socket_ifname:
        extra["GLOO_SOCKET_IFNAME"] = cluster.gloo_socket_ifname
    commands = []
    for rank in range(cluster.nnodes):
        argv = (python, "-m", "atom.launch", "--nnodes", str(cluster.nnodes),
                "--node-rank", str(rank), "--nproc-per-node", str(cluster.nproc_per_node),
                "--master-addr", cluster.master_addr, "--master-port", str(cluster.master_port),
                "--log-dir", log_dir(rank), *launch_args, "--",
                "serve", "--host", cluster.master_addr, "--port", str(cluster.http_port),
                *serve_args)
        commands.append(NodeCommand(node_rank=rank, argv=argv, env=extra))
    return commands


def driver_env(extra: Mapping[str, str]) -> dict[str, str]:
    """This process's environment without any rank contract it may carry, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if k not in _DROPPED_ENV}
    return {**env, **extra}


class LocalNode:
    """A launcher started on this machine (``wrap`` puts it in its namespace). Owns the
    process and its log file (stdout and stderr together)."""

    def __init__(self, command: NodeCommand, *, log_path: str,
                 wrap: Callable[[list[str]], list[str]] = list,
                 leftovers: Callable[[], list[int]] = lambda: []):
        self.node_rank = command.node_rank
        self.log_path = log_path
        self._leftovers = leftovers
        self._log = open(log_path, "wb")
        try:
            self.proc = subprocess.Popen(wrap(list(command.argv)), env=driver_env(command.env),
                                         stdin=subprocess.DEVNULL, stdout=self._log,
                                         stderr=subprocess.STDOUT, start_new_session=True)
        except OSError:
            self._log.close()
            raise

    def poll(self) -> int | None:
        return self.proc.poll()

    def send_signal(self, sig: int) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)

    def leftovers(self) -> list[str]:
        """What still runs on the node after the launcher exited (pids, as text)."""
        return [str(p) for p in self._leftovers()]

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        self._log.close()


class SshNode(LocalNode):
    """A launcher started over ssh (module docstring; untested here). The local ``ssh`` process
    carries the launcher's output into the log; signals go to the remote pid."""

    def __init__(self, command: NodeCommand, *, log_path: str, destination: str,
                 workdir: str | None):
        self.destination = destination
        remote = f"echo PID $$ && exec {command.shell()}"
        if workdir:
            remote = f"cd {shlex.quote(workdir)} && {remote}"
        ssh = ["ssh", "-o", "BatchMode=yes", destination, remote]
        super().__init__(NodeCommand(command.node_rank, tuple(ssh), {}), log_path=log_path)

    def remote_pid(self) -> int | None:
        """The launcher's pid on the node (the log's first line), None until it is there."""
        try:
            with open(self.log_path) as f:
                first = f.readline().split()
        except OSError:
            return None
        return int(first[1]) if first[:1] == ["PID"] and len(first) > 1 else None

    def send_signal(self, sig: int) -> None:
        pid = self.remote_pid()
        if pid is not None:
            subprocess.run(["ssh", "-o", "BatchMode=yes", self.destination,
                            f"kill -{signal.Signals(sig).name[3:]} {pid}"], check=False)
        elif sig == signal.SIGKILL:
            super().send_signal(sig)

    def leftovers(self) -> list[str]:
        pid = self.remote_pid()
        if pid is None:
            return []
        alive = subprocess.run(["ssh", "-o", "BatchMode=yes", self.destination,
                                f"kill -0 {pid}"], check=False).returncode == 0
        return [f"{self.destination}:{pid}"] if alive else []


def log_tail(path: str, num_lines: int = _LOG_TAIL_LINES) -> str:
    """The last lines of a node's log ("" when there is none)."""
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-num_lines:])
    except OSError:
        return ""


class Deployment:
    """The launchers of one run (one per node, started). Owns the node processes."""

    def __init__(self, nodes: list[LocalNode], *, base_url: str):
        self.nodes = nodes
        self.base_url = base_url

    def wait_healthy(self, timeout_s: float) -> None:
        """Poll node 0's ``/health`` until 200.

        Raises:
            RuntimeError: a launcher exited first (its log tail in the message), or the server
                was not healthy within ``timeout_s``.
        """
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for node in self.nodes:
                if node.poll() is not None:
                    raise RuntimeError(f"node {node.node_rank}'s launcher exited with code "
                                       f"{node.poll()} before the deployment was healthy; the "
                                       f"end of {node.log_path}:\n{log_tail(node.log_path)}")
            try:
                if httpx.get(self.base_url + "/health", timeout=5.0).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(_HEALTH_POLL_S)  # polling a server that is loading, with a deadline
        raise RuntimeError(f"{self.base_url}/health was not 200 within {timeout_s:g}s")

    def stop(self, timeout_s: float) -> dict[int, int]:
        """Stop every node (module docstring); node rank → launcher exit code."""
        self.nodes[0].send_signal(signal.SIGTERM)
        for sig in (signal.SIGTERM, signal.SIGKILL):
            if self._wait_all(timeout_s):
                break
            late = [n.node_rank for n in self.nodes if n.poll() is None]
            logger.warning("launchers of nodes %s still running after %gs: %s", late,
                           timeout_s, signal.Signals(sig).name)
            for node in self.nodes:
                node.send_signal(sig)
        codes = {}
        for node in self.nodes:
            node.close()
            codes[node.node_rank] = node.poll()
        return codes

    def _wait_all(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while any(n.poll() is None for n in self.nodes):
            if time.monotonic() > deadline:
                return False
            time.sleep(0.2)  # polling exits (several processes, one deadline)
        return True

    def leftovers(self) -> dict[int, list[str]]:
        """Node rank → what still runs there after :meth:`stop` (empty when clean)."""
        return {n.node_rank: left for n in self.nodes if (left := n.leftovers())}
