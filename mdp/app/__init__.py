"""Entry points: ``IService``\\ s to embed, the ``twist`` plugins' service
makers and the ``mdp`` command line.  Thin: they parse options and wire the
patterns to transports."""
