"""Elastic scheduler service, worker agent, protocol, client."""
