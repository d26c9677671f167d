"""Resource providers: what ``resources/list``, ``resources/read`` and templates answer from."""

from broker.resources.base import ResourceProvider, Resources

__all__ = ["ResourceProvider", "Resources"]
