"""SSH to the servers of a cluster (paramiko): where and as whom to connect, host keys, key authentication."""


class SshError(Exception):
    """Something went wrong with one server; the message is one line for a person."""
