"""Titanic: disk-backed, disconnected request-reply on top of Majordomo (the Guide's Titanic
pattern, ZeroMQ RFC 9), as an MDP worker and client: the broker and workers are unchanged.

* :class:`Titanic`: the services, the dispatcher and a store in one;
* :class:`TitanicClient`: submit now, collect later;
* :mod:`mdp.titanic.protocol`: the dialog as pure functions.
"""

from mdp.titanic.client import TitanicClient
from mdp.titanic.protocol import TitanicRefused, TitanicRequestTooLarge, TitanicStoreFull
from mdp.titanic.server import Titanic, TitanicServer
from mdp.titanic.store import ITitanicStore, MemoryStore, SQLiteStore, open_store

__all__ = ["ITitanicStore", "MemoryStore", "SQLiteStore", "Titanic", "TitanicClient",
           "TitanicRefused", "TitanicRequestTooLarge", "TitanicServer", "TitanicStoreFull",
           "open_store"]
