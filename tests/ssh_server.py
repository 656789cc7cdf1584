"""A real OpenSSH server for the tests of launches on several hosts: one sshd per test session, run as the
current user on a free port of 127.0.0.1 with generated keys, and an SSH config naming two aliases of this
machine (HOSTS). Tests pass the config to nbaccel with NBACCEL_SSH_CONFIG (ssh -F)."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from nbaccel.utils.other import get_free_port

HOSTS = ("nbaccel-host-a", "nbaccel-host-b")
SSHD = "/usr/sbin/sshd"


@dataclass(frozen=True)
class SshServer:
    """A running sshd and the client config that reaches it under HOSTS."""

    process: subprocess.Popen
    port: int
    folder: Path
    config: Path  # the client's config file (ssh -F)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def _keygen(path: Path) -> None:
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(path)], check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def missing_reason() -> str | None:
    """Why no sshd can run here, or None."""
    if not os.path.exists(SSHD):
        return f"{SSHD} is not installed (apt-get install openssh-server; .ci/run does it)"
    for tool in ("ssh", "ssh-keygen"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (apt-get install openssh-client)"
    return None


def start_server(folder: Path, timeout: float = 20.0) -> SshServer:
    """Generate the keys and configs in `folder`, start sshd, wait until it accepts a login; RuntimeError
    with sshd's own words when it does not."""
    folder.mkdir(parents=True, exist_ok=True)
    os.chmod(folder, 0o700)
    host_key, user_key = folder / "host_key", folder / "user_key"
    _keygen(host_key)
    _keygen(user_key)
    shutil.copy(folder / "user_key.pub", folder / "authorized_keys")
    os.chmod(folder / "authorized_keys", 0o600)
    port = get_free_port("127.0.0.1")
    (folder / "sshd_config").write_text(
        f"Port {port}\nListenAddress 127.0.0.1\nHostKey {host_key}\nPidFile {folder / 'sshd.pid'}\n"
        f"AuthorizedKeysFile {folder / 'authorized_keys'}\nPasswordAuthentication no\n"
        "KbdInteractiveAuthentication no\nPubkeyAuthentication yes\nPermitRootLogin prohibit-password\n"
        "UsePAM no\nStrictModes no\nPrintMotd no\nLogLevel ERROR\nMaxStartups 50\nMaxSessions 50\n"
    )
    known = folder / "known_hosts"
    public = (folder / "host_key.pub").read_text().split()
    known.write_text(f"[127.0.0.1]:{port} {public[0]} {public[1]}\n")
    config = folder / "ssh_config"
    config.write_text("".join(
        f"Host {alias}\n  HostName 127.0.0.1\n  Port {port}\n  User {_user()}\n  IdentityFile {user_key}\n"
        f"  IdentitiesOnly yes\n  UserKnownHostsFile {known}\n  StrictHostKeyChecking yes\n"
        f"  HostKeyAlias [127.0.0.1]:{port}\n  BatchMode yes\n  LogLevel ERROR\n"
        for alias in HOSTS))
    if os.geteuid() == 0:
        os.makedirs("/run/sshd", mode=0o755, exist_ok=True)  # sshd's privilege separation directory
    log = open(folder / "sshd.log", "wb")
    process = subprocess.Popen([SSHD, "-D", "-e", "-f", str(folder / "sshd_config")], stdout=log,
                               stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    log.close()
    server = SshServer(process, port, folder, config)
    deadline = time.monotonic() + timeout
    while True:
        probe = subprocess.run(["ssh", "-F", str(config), HOSTS[0], "true"], capture_output=True, text=True,
                               timeout=timeout)
        if probe.returncode == 0:
            return server
        if process.poll() is not None or time.monotonic() > deadline:
            server.stop()
            raise RuntimeError(f"sshd did not accept a login: {probe.stderr.strip()}; sshd said: "
                               f"{(folder / 'sshd.log').read_text(errors='replace')[-2000:]}")
        time.sleep(0.2)


def _user() -> str:
    import getpass

    return getpass.getuser()
