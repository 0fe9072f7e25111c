"""Where and as whom to connect: a server's config entry, completed by ``~/.ssh/config``.

Precedence follows OpenSSH's, with ``jabas.toml`` in the place of the command
line: a key set in the server's entry wins, then the first matching
``~/.ssh/config`` value (looked up by the entry's ``host``), then the default
(port 22, your local user name, your ``~/.ssh/id_*`` keys and ssh-agent).
"""

from __future__ import annotations

import getpass
import os
from dataclasses import dataclass
from pathlib import Path

from paramiko import SSHConfig
from paramiko.ssh_exception import ConfigParseError

from jabascli.config.models import ServerConfig
from jabascli.errors import InputError
from jabascli.ssh import SshError

DEFAULT_SSH_CONFIG = Path("~/.ssh/config")


@dataclass(frozen=True)
class SshTarget:
    """Everything needed to open one server's SSH connection."""

    server: str
    """The server's name in the config."""
    hostname: str
    port: int
    user: str
    key_files: tuple[Path, ...] = ()
    """Private keys to offer, in order (before the agent's)."""
    allow_agent: bool = True
    default_keys: bool = True
    """Whether to offer ``~/.ssh/id_*`` too (only when no key is named, as OpenSSH does)."""
    connect_timeout: float | None = None
    sync_root: str | None = None

    @property
    def address(self) -> str:
        return f"{self.user}@{self.hostname}:{self.port}"


def load_ssh_config(path: Path | None) -> SSHConfig | None:
    """The given OpenSSH client config (``/dev/null`` for none), else ``~/.ssh/config`` where present."""
    explicit = path is not None
    path = (path or DEFAULT_SSH_CONFIG).expanduser()
    if not path.exists():
        if explicit:
            raise InputError.at(path, None, "SSH config file not found")
        return None
    if path.is_dir():
        raise InputError.at(path, None, "is a folder, expected an SSH config file")
    try:
        return SSHConfig.from_path(str(path))
    except (ConfigParseError, OSError, UnicodeDecodeError) as exc:
        raise InputError.at(path, None, f"cannot read SSH config: {exc}") from None


def resolve_target(server: ServerConfig, ssh_config: SSHConfig | None) -> SshTarget:
    """Combine a server entry with its ``~/.ssh/config`` block (see the module doc)."""
    options = ssh_config.lookup(server.host) if ssh_config is not None else {"hostname": server.host}
    for key, spelled in (("proxyjump", "ProxyJump"), ("proxycommand", "ProxyCommand")):
        value = options.get(key)
        if value and value.lower() != "none":
            raise SshError(
                f"~/.ssh/config sets {spelled} for {server.host}, which jabas does not support yet: "
                "give an address it can reach directly as the server's host"
            )
    explicit = server.model_fields_set

    if "ssh_port" in explicit or "port" not in options:
        port = server.ssh_port
    else:
        try:
            port = int(options["port"])
        except ValueError:
            raise SshError(f"~/.ssh/config gives {server.host} the port {options['port']!r}, not a number") from None
    user = server.ssh_user or options.get("user") or getpass.getuser()

    if server.ssh_key is not None:
        keys: tuple[Path, ...] = (server.ssh_key,)
    else:
        # OpenSSH skips IdentityFiles that do not exist; so do we.
        named = [Path(os.path.expanduser(p)) for p in options.get("identityfile", [])]
        keys = tuple(p for p in named if p.is_file())
    identities_only = str(options.get("identitiesonly", "no")).lower() == "yes"
    timeout = options.get("connecttimeout")
    return SshTarget(
        server=server.name,
        hostname=options.get("hostname", server.host),
        port=port,
        user=user,
        key_files=keys,
        allow_agent=not identities_only,
        default_keys=not keys,
        connect_timeout=float(timeout) if timeout and timeout.isdigit() else None,
        sync_root=server.sync_root,
    )
