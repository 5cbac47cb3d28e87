"""Handlers loaded by name (``module:callable``) in process tests."""


def upper(frames: list[bytes]) -> list[bytes]:
    return [frame.upper() for frame in frames]
