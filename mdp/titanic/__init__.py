"""Titanic: disk-backed, disconnected request-reply on top of Majordomo (the
Guide's Titanic pattern, the Titanic Service Protocol).  Titanic is an MDP
worker and an MDP client; it changes neither the broker nor ordinary workers.

So far: the storage layer (:mod:`mdp.titanic.store`)."""
