"""swarm-node: one peer of a swarm that post-trains a language model with reinforcement learning."""

__version__ = "0.1.0"
