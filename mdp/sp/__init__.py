"""SP REQ/REP: the scalability protocols' request-reply (nanomsg, nng).

``mdp.sp.codec`` holds the pure parts: backtraces, request and channel ids,
nng URLs.  The TCP mapping is a stream framing of the transport layer
(:mod:`mdp.transport.spframing`).
"""
