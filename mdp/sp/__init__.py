"""SP REQ/REP: the scalability protocols' request-reply (nanomsg, nng)."""
