"""A real single-machine Slurm for the tests and `cpn up --slurm`: munged, MariaDB, slurmdbd,
slurmctld and slurmd, each our own child on its own loopback port, configured in one directory.

Nothing here touches the host's own Slurm or munge: the configuration (slurm.conf, gres.conf,
slurmdbd.conf, a munge key) is generated under ``root``, the daemons run in the foreground as
children of this process and are stopped by pid, and client commands find the cluster through
``SLURM_CONF`` (``env()``). GPUs are declared as GRES on empty placeholder files (no GPU is
needed; Slurm 22.05 ignores a GPU without ``File=``); ``SlurmdParameters=config_overrides``
lets the node declare more CPUs and memory than the machine has. MariaDB and slurmdbd are there
so that ``sacct`` truly answers.

The packages come from ``.ci/install-slurm`` (Debian/Ubuntu, as root); ``missing()`` names the
programs still absent.
"""

from __future__ import annotations

import logging
import os
import secrets
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from sites.errors import SitesError
from sites.etcd_server import free_port

log = logging.getLogger(__name__)

CLIENTS = ("sbatch", "squeue", "sacct", "sacctmgr", "scontrol", "sinfo", "scancel")
DAEMONS = ("munged", "mariadbd", "mariadb-install-db", "slurmdbd", "slurmctld", "slurmd")
SBIN = ("/usr/sbin", "/sbin", "/usr/local/sbin")


class SlurmStartError(SitesError):
    """The local Slurm (or one of its daemons) did not start; the message names which and why."""


def which(name: str) -> str | None:
    """``name`` on PATH or in the sbin directories (daemons live there, often off PATH)."""
    path = os.pathsep.join([os.environ.get("PATH", os.defpath), *SBIN])
    return shutil.which(name, path=path)


def missing() -> list[str]:
    """The client commands and daemons a local Slurm needs that this machine lacks."""
    return [name for name in (*CLIENTS, *DAEMONS) if which(name) is None]


@dataclass
class _Daemon:
    name: str
    proc: subprocess.Popen[bytes]
    log_path: Path


@dataclass
class LocalSlurm:
    """One node (this host) with ``cpus`` CPUs, ``mem_mb`` MB and ``gres`` GPUs by type.

    ``accounts`` are created in slurmdbd (with ``AccountingStorageEnforce=associations``, so a
    job naming any other account is refused); the user running the tests may use each.
    """

    root: Path
    cluster: str = "cpn"
    partition: str = "debug"
    cpus: int = 8
    mem_mb: int = 16000
    gres: Mapping[str, int] = field(default_factory=lambda: {"h100": 4})
    accounts: Sequence[str] = ("cpn",)
    kill_wait_s: int = 2
    node: str = field(default_factory=socket.gethostname)
    _daemons: list[_Daemon] = field(default_factory=list, init=False)

    @property
    def user(self) -> str:
        """The user the daemons run as and the tests submit as."""
        return _user()

    @property
    def conf(self) -> Path:
        return self.root / "slurm.conf"

    def env(self, base: Mapping[str, str] | None = None) -> dict[str, str]:
        """``base`` (default: os.environ) with SLURM_CONF pointing at this cluster."""
        env = dict(os.environ if base is None else base)
        env["SLURM_CONF"] = str(self.conf)
        return env

    # -- lifecycle ------------------------------------------------------------------------------

    def start(self, timeout_s: float = 60.0) -> None:
        """Configure and start every daemon; returns once the node takes jobs."""
        absent = missing()
        if absent:
            raise SlurmStartError(
                f"Slurm is not installed (missing: {', '.join(absent)}); run .ci/install-slurm"
            )
        started = time.monotonic()
        try:
            self._configure()
            self._start_munge()
            self._start_mariadb(timeout_s)
            self._start_slurmdbd(timeout_s)
            self._add_associations()
            self._spawn("slurmctld", [_need("slurmctld"), "-D", "-i", "-f", str(self.conf)])
            self._wait("slurmctld", lambda: self._ok("scontrol", "ping"), timeout_s)
            self._spawn("slurmd", [_need("slurmd"), "-D", "-f", str(self.conf), "-N", self.node])
            self._wait("slurmd", self._node_ready, timeout_s)
        except BaseException:
            self.stop()
            raise
        log.info("local Slurm up in %.1fs at %s", time.monotonic() - started, self.root)

    def stop(self) -> None:
        """SIGTERM our daemons, newest first (SIGKILL after 10 s); idempotent."""
        for daemon in reversed(self._daemons):
            if daemon.proc.poll() is None:
                daemon.proc.send_signal(signal.SIGTERM)
                try:
                    daemon.proc.wait(10)
                except subprocess.TimeoutExpired:
                    log.warning("%s ignored SIGTERM; killing it", daemon.name)
                    daemon.proc.kill()
                    daemon.proc.wait()
        self._daemons.clear()

    def __enter__(self) -> LocalSlurm:
        self.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.stop()

    def run(self, *argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        """A client command against this cluster (e.g. ``run("scontrol", "ping")``)."""
        result = subprocess.run(
            [_need(argv[0]), *argv[1:]], capture_output=True, text=True, env=self.env(), timeout=30
        )
        if check and result.returncode != 0:
            raise SlurmStartError(f"{' '.join(argv)}: {(result.stderr or result.stdout).strip()}")
        return result

    def logs(self) -> str:
        """The tail of every daemon's log, for a failing test's message."""
        out = []
        for daemon in self._daemons:
            text = daemon.log_path.read_text(errors="replace") if daemon.log_path.exists() else ""
            out.append(f"--- {daemon.name} ---\n{text[-2000:]}")
        return "\n".join(out)

    # -- configuration --------------------------------------------------------------------------

    def _configure(self) -> None:
        r = self.root
        for sub in ("state", "spool", "log", "db", "run"):
            (r / sub).mkdir(parents=True, exist_ok=True)
        r.chmod(0o755)  # slurmd runs jobs as the submitting user; they must reach their files
        self._ports = {name: free_port() for name in ("slurmctld", "slurmd", "slurmdbd", "mariadb")}
        key = r / "munge.key"
        key.write_bytes(secrets.token_bytes(1024))
        key.chmod(0o400)
        self._munge_socket = r / "run" / "munge.socket"
        gres = ",".join(f"gpu:{kind}:{count}" for kind, count in self.gres.items())
        tres = ",".join(["gres/gpu", *(f"gres/gpu:{kind}" for kind in self.gres)])
        user = _user()
        conf = f"""\
# generated by sites/slurm_cluster.py: a single-machine Slurm for cpn's tests and demo
ClusterName={self.cluster}
SlurmctldHost={self.node}(127.0.0.1)
SlurmctldPort={self._ports["slurmctld"]}
SlurmdPort={self._ports["slurmd"]}
SlurmUser={user}
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={self._munge_socket}
CredType=cred/munge
StateSaveLocation={r / "state"}
SlurmdSpoolDir={r / "spool"}
SlurmctldPidFile={r / "run" / "slurmctld.pid"}
SlurmdPidFile={r / "run" / "slurmd.pid"}
SlurmctldLogFile={r / "log" / "slurmctld.log"}
SlurmdLogFile={r / "log" / "slurmd.log"}
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SwitchType=switch/none
MpiDefault=none
LaunchParameters=use_interactive_step
ReturnToService=2
SlurmdParameters=config_overrides
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
GresTypes=gpu
JobAcctGatherType=jobacct_gather/linux
JobAcctGatherFrequency=task=1
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=127.0.0.1
AccountingStoragePort={self._ports["slurmdbd"]}
AccountingStoragePass={self._munge_socket}
AccountingStorageEnforce=associations,limits,qos
AccountingStorageTRES={tres}
AccountingStoreFlags=job_comment
JobCompType=jobcomp/none
DefMemPerCPU=256
KillWait={self.kill_wait_s}
MinJobAge=300
InactiveLimit=0
SlurmctldTimeout=300
SlurmdTimeout=300
NodeName={self.node} NodeAddr=127.0.0.1 CPUs={self.cpus} RealMemory={self.mem_mb} \
Gres={gres} State=UNKNOWN
PartitionName={self.partition} Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"""
        self.conf.write_text(conf)
        # Slurm 22.05 drops a GPU that has no File= ("Removing file-less GPU"), so each one is
        # an empty placeholder file: no device behind it, a fake that stands in for the GPU
        (r / "dev").mkdir(exist_ok=True)
        lines, index = [], 0
        for kind, count in self.gres.items():
            files = [r / "dev" / f"gpu{index + i}" for i in range(count)]
            for path in files:
                path.touch()
            spec = f"{r / 'dev'}/gpu[{index}-{index + count - 1}]" if count > 1 else files[0]
            lines.append(f"NodeName={self.node} Name=gpu Type={kind} File={spec}")
            index += count
        (r / "gres.conf").write_text("\n".join(lines) + "\n")
        dbd = r / "slurmdbd.conf"
        dbd.write_text(f"""\
AuthType=auth/munge
AuthInfo=socket={self._munge_socket}
DbdHost={self.node}
DbdAddr=127.0.0.1
DbdPort={self._ports["slurmdbd"]}
SlurmUser={user}
PidFile={r / "run" / "slurmdbd.pid"}
LogFile={r / "log" / "slurmdbd.log"}
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort={self._ports["mariadb"]}
StorageUser=root
StorageLoc=slurm_acct_db
""")
        dbd.chmod(0o600)  # slurmdbd refuses a config others can read (it may hold a password)

    # -- daemons --------------------------------------------------------------------------------

    def _start_munge(self) -> None:
        r = self.root
        self._spawn(
            "munged",
            [
                _need("munged"), "--foreground", "--force",
                f"--socket={self._munge_socket}", f"--key-file={r / 'munge.key'}",
                f"--pid-file={r / 'run' / 'munged.pid'}", f"--seed-file={r / 'run' / 'munge.seed'}",
                f"--log-file={r / 'log' / 'munged.log'}",
            ],
        )  # fmt: skip
        self._wait("munged", self._munge_socket.exists, 10)

    def _start_mariadb(self, timeout_s: float) -> None:
        r = self.root
        datadir = r / "db"
        init = subprocess.run(
            [
                _need("mariadb-install-db"), "--no-defaults", f"--datadir={datadir}",
                "--user=root", "--skip-test-db", "--auth-root-authentication-method=normal",
            ],
            capture_output=True, text=True, timeout=timeout_s,
        )  # fmt: skip
        if init.returncode != 0:
            raise SlurmStartError(f"mariadb-install-db failed: {init.stderr.strip()[-500:]}")
        self._spawn(
            "mariadbd",
            [
                _need("mariadbd"), "--no-defaults", f"--datadir={datadir}", "--user=root",
                f"--port={self._ports['mariadb']}", "--bind-address=127.0.0.1",
                f"--socket={r / 'run' / 'mysqld.sock'}", f"--pid-file={r / 'run' / 'mysqld.pid'}",
                "--skip-grant-tables", "--skip-name-resolve", "--skip-log-bin",
                "--innodb-buffer-pool-size=32M", "--innodb-log-file-size=16M",
                "--innodb-flush-log-at-trx-commit=0", "--innodb-doublewrite=0",
                f"--log-error={r / 'log' / 'mariadb.log'}",
            ],
        )  # fmt: skip
        self._wait("mariadbd", lambda: _port_open(self._ports["mariadb"]), timeout_s)

    def _start_slurmdbd(self, timeout_s: float) -> None:
        # slurmdbd reads slurmdbd.conf from the directory of $SLURM_CONF
        self._spawn("slurmdbd", [_need("slurmdbd"), "-D"])
        self._wait("slurmdbd", lambda: _port_open(self._ports["slurmdbd"]), timeout_s)

    def _add_associations(self) -> None:
        self.run("sacctmgr", "-i", "add", "cluster", self.cluster)
        for account in self.accounts:
            self.run("sacctmgr", "-i", "add", "account", account, f"cluster={self.cluster}")
        self.run(
            "sacctmgr", "-i", "add", "user", _user(), f"account={','.join(self.accounts)}",
            f"cluster={self.cluster}",
        )  # fmt: skip

    def _node_ready(self) -> bool:
        result = self.run("sinfo", "-h", "-N", "-o", "%T", check=False)
        states = result.stdout.split()
        return (
            result.returncode == 0
            and bool(states)
            and all(s.rstrip("*~#") in ("idle", "mixed", "allocated") for s in states)
        )

    def _ok(self, *argv: str) -> bool:
        return self.run(*argv, check=False).returncode == 0

    def _spawn(self, name: str, argv: list[str], env: Mapping[str, str] | None = None) -> None:
        log_path = self.root / "log" / f"{name}.out"
        with open(log_path, "ab") as out:
            proc = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=dict(env) if env is not None else self.env(),
                start_new_session=True,  # a Ctrl-C at the terminal is ours to handle, not theirs
            )
        self._daemons.append(_Daemon(name, proc, log_path))

    def _wait(self, name: str, ready: object, timeout_s: float) -> None:
        check = ready if callable(ready) else (lambda: False)
        daemon = next((d for d in self._daemons if d.name == name), None)
        deadline = time.monotonic() + timeout_s
        while not check():
            if daemon is not None and daemon.proc.poll() is not None:
                raise SlurmStartError(
                    f"{name} exited with {daemon.proc.returncode}:\n{self._tail(name)}"
                )
            if time.monotonic() > deadline:
                tail = self._tail(name)
                raise SlurmStartError(f"{name} not ready within {timeout_s:.0f}s:\n{tail}")
            time.sleep(0.1)

    def _tail(self, name: str) -> str:
        texts = []
        for path in (self.root / "log").glob(f"{name.removesuffix('d')}*"):
            texts.append(path.read_text(errors="replace")[-1500:])
        return "\n".join(texts)


def _need(name: str) -> str:
    path = which(name)
    if path is None:
        raise SlurmStartError(f"{name} not found; run .ci/install-slurm")
    return path


def _user() -> str:
    import pwd

    return pwd.getpwuid(os.getuid()).pw_name


def _port_open(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.settimeout(0.2)
        return sock.connect_ex(("127.0.0.1", port)) == 0
