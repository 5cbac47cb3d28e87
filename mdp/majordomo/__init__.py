"""Majordomo (MDP/0.2): the wire codec, the broker, worker and client state
machines, MMI service discovery and the reply store for idempotent retries."""
