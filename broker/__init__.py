"""mcp-broker: a horizontally scaled MCP server for resources and their change notifications."""

from broker.changes import Change, ChangeKind
from broker.config import Settings

__version__ = "0.1.0"

__all__ = ["Change", "ChangeKind", "Settings", "__version__"]
