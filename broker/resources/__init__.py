"""Resource providers: what ``resources/list``, ``resources/read`` and templates answer from."""

from broker.resources.base import ResourceProvider, Resources
from broker.resources.functions import ResourceSet

__all__ = ["ResourceProvider", "ResourceSet", "Resources"]
