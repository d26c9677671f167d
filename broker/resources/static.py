"""Fixed resources and URI templates served from memory: the simplest custom provider.

Register one from Python (``broker.register(StaticProvider(...))``) for documents that rarely
change; when one does, replace it with ``set`` and publish the change.
"""

from __future__ import annotations

import base64
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from broker.auth import Principal
from broker.errors import NotFound

__all__ = ["StaticProvider", "StaticResource", "Template"]

Json = dict[str, Any]


@dataclass(frozen=True, slots=True)
class StaticResource:
    uri: str
    name: str
    mime_type: str
    text: str | None = None
    blob: bytes | None = None
    description: str | None = None

    def listing(self) -> Json:
        item: Json = {"uri": self.uri, "name": self.name, "mimeType": self.mime_type}
        if self.description:
            item["description"] = self.description
        size = len(self.blob) if self.blob is not None else len((self.text or "").encode())
        item["size"] = size
        return item

    def contents(self) -> Json:
        if self.blob is not None:
            return {"uri": self.uri, "mimeType": self.mime_type, "blob": base64.b64encode(self.blob).decode()}
        return {"uri": self.uri, "mimeType": self.mime_type, "text": self.text or ""}


@dataclass(frozen=True)
class Template:
    """An RFC 6570 level-1 template (``{var}`` segments) and a function from its variables to text."""

    uri_template: str
    name: str
    mime_type: str
    render: Callable[[dict[str, str]], str]
    pattern: re.Pattern[str] = field(init=False)

    def __post_init__(self) -> None:
        parts = re.split(r"\{(\w+)\}", self.uri_template)
        regex = "".join(re.escape(p) if i % 2 == 0 else f"(?P<{p}>[^/?#]+)" for i, p in enumerate(parts))
        object.__setattr__(self, "pattern", re.compile(regex))

    def match(self, uri: str) -> dict[str, str] | None:
        found = self.pattern.fullmatch(uri)
        return found.groupdict() if found else None


class StaticProvider:
    """Serves its resources to every principal; owns URIs under the given prefixes."""

    def __init__(self, prefixes: tuple[str, ...], resources: Sequence[StaticResource] = (),
                 templates: Sequence[Template] = ()) -> None:
        self.prefixes = prefixes
        self.resources: dict[str, StaticResource] = {r.uri: r for r in resources}
        self._templates = list(templates)

    def set(self, resource: StaticResource) -> None:
        self.resources[resource.uri] = resource

    def owns(self, uri: str) -> bool:
        return uri.startswith(self.prefixes)

    def can_watch(self, principal: Principal, uri: str) -> bool:
        return True

    async def list_page(self, principal: Principal, state: str | None, limit: int) -> tuple[list[Json], str | None]:
        uris = sorted(self.resources)
        start = 0 if not state else next((i for i, u in enumerate(uris) if u > state), len(uris))
        page = uris[start : start + limit]
        more = start + limit < len(uris)
        return [self.resources[u].listing() for u in page], (page[-1] if more and page else None)

    async def read(self, principal: Principal, uri: str) -> list[Json]:
        resource = self.resources.get(uri)
        if resource is not None:
            return [resource.contents()]
        for template in self._templates:
            args = template.match(uri)
            if args is not None:
                return [{"uri": uri, "mimeType": template.mime_type, "text": template.render(args)}]
        raise NotFound(uri)

    def templates(self, principal: Principal) -> list[Json]:
        return [{"uriTemplate": t.uri_template, "name": t.name, "mimeType": t.mime_type} for t in self._templates]
