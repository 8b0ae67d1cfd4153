"""The one exception type the edge raises for bad input or a setup it cannot run with."""
from __future__ import annotations


class EdgeError(ValueError):
    """Bad input to the edge (a prompt too long for the model, a malformed state file,
    an unknown model) or a configuration it cannot run with. The agent never lets it
    escape while serving: a failing event is escalated or answered with the error."""
