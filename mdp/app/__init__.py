"""Entry points: services to embed, ``twist`` plugins, the ``mdp`` command."""
