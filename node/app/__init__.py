"""The program around the node: the ``swarm-node`` command line, the status view, the local swarm and
the demo, the config reference, and the tool subcommands that start a node (``shards seed``...).

The top of the stack: app/ may import anything in node/, nothing in node/ imports app/.
"""
