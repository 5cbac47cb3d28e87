"""Titanic: disk-backed, disconnected request-reply on top of Majordomo (the
Guide's Titanic pattern, the Titanic Service Protocol, ZeroMQ RFC 9).  Titanic
is an MDP worker and an MDP client; it changes neither the broker nor
ordinary workers.

* :class:`Titanic` (:mod:`mdp.titanic.server`): the three services, the
  dispatcher (:mod:`mdp.titanic.dispatcher`) and a store
  (:mod:`mdp.titanic.store`) in one;
* :class:`TitanicClient` (:mod:`mdp.titanic.client`): submit now, collect
  later;
* :mod:`mdp.titanic.protocol`: the dialog as pure functions.
"""

from mdp.titanic.client import TitanicClient
from mdp.titanic.server import Titanic, TitanicServer, open_store
from mdp.titanic.store import ITitanicStore, MemoryStore, SQLiteStore

__all__ = ["ITitanicStore", "MemoryStore", "SQLiteStore", "Titanic", "TitanicClient",
           "TitanicServer", "open_store"]
