"""Every Redis key and pub/sub channel of the broker, under one configurable prefix.

Layout (``P`` is ``settings.redis_prefix``; ``{...}`` is the Redis Cluster hash tag):

=============================  ==========  ===================================================
key                            type        what
=============================  ==========  ===================================================
``P:epoch``                    string      the data generation, SET NX at start
``P:partitions``               string      change-log partition count of the current layout
``P:partitioning``             string      the change log's layouts, JSON (``partitioning``)
``P:registry``                 zset        ``"<sid> <tenant>"`` scored by a deadline (count, expiry)
``P:registry:sessions``        zset        the feeds of kind session among them, by the same deadline (count)
``P:{t:<tenant>}:sessions``    zset        the tenant's sessions, scored by the same deadline
``P:{t:<tenant>}:q:<kind>``    zset        the tenant's open streams or listens, scored by lease expiry (quotas)
``P:{t:<tenant>}:q:rate``      hash        the tenant's publish token bucket (quotas)
``P:{s:<sid>}:meta``           hash        the session record, inbox ``head`` and ``t0``, stream claim ``gen``, ``born``
``P:{s:<sid>}:subs``           set         the session's subscribed URIs
``P:{s:<sid>}:inbox``          stream      the session's frames; entry id ``<offset>-0``
``P:{s:<sid>}:wake``           channel     wake-ups of the stream watching the session
``P:{i:<tenant>:<uri>}``       set         the index: session ids subscribed to one URI
``P:{c:<n>}:log``              stream      change-log partition ``n`` (consumer group ``fanout``)
``P:{c:<n>}:backlog``          hash        per tenant: changes of partition ``n`` not yet fanned out
``P:{c:<n>}:lease``            string      the fan-out consumer that alone reads partition ``n`` now
``P:{c:<n>}:sealed``           string      set once partition ``n`` takes no more appends (a switch)
``P:fanout``                   zset        live fan-out consumers (score: when each lapses), for shares
``P:lease:<name>``             string      the owner of a named lease (``base.Leases``)
``P:{u:<upstream>}:want``      zset        the URIs of an upstream the deployment wants watched, to a deadline
``P:{c:<n>}:rec:<t>/<c>``      hash        records of collection ``c`` of tenant ``t``
``P:{c:<n>}:ids:<t>/<c>``      zset        their ids, score 0, for ordered paging
``P:{c:<n>}:cols:<t>``         zset        the tenant's non-empty collections
``P:{c:<n>}:use:<t>``          hash        the tenant's records (``n``) and their bytes (``b``), for its quota
``P:bcast``                    channel     changes for modern listens, subscribed by every worker that has any
``P:{k}:key:<id>``             hash        a runtime API key's record (``base.Credentials``), never the key
``P:{k}:digest:<sha256>``      string      the id of the key with that digest
``P:{k}:ids``                  zset        every key's id, score 0, for ordered paging
``P:{k}:ids:<tenant>``         zset        the tenant's key ids, likewise
=============================  ==========  ===================================================

``<tenant>`` and ``<t>`` are the tenant name escaped (``%``, ``:``, ``{``, ``}``, ``/`` as ``%XX``):
the names are injective whatever the input, so a tenant ``a:b`` never shares a key with tenant
``a`` (``{i:a:b:x}`` would be tenant ``a``'s URI ``b:x``), and a valid tenant name (see
``broker.tenants``) is written as it is, so keys made before the escaping are still found.

A session's keys and its wake channel share the tag ``{s:<sid>}``, so each session script runs
in one Cluster slot. A collection's records share the tag of the change-log partition the
collection maps to (``{c:<n>}``, ``partitioning``), so a record write and its change are one
atomic script; a tenant's record usage and collection list are kept per partition beside them. The index and
the tenant session sets are cross-slot from the session; they are written in a second step.
The API keys share the tag ``{k}``: they are few, and each create or revocation is one script.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["FANOUT_GROUP", "Keys", "SessionKeys", "escape_tenant"]

#: The consumer group of the change log.
FANOUT_GROUP = "fanout"


_ESCAPES = str.maketrans({"%": "%25", ":": "%3A", "{": "%7B", "}": "%7D", "/": "%2F"})


def escape_tenant(tenant: str) -> str:
    """The tenant part of a key: no separator (``:``, ``/``), hash-tag brace or ``%`` left unescaped."""
    return tenant.translate(_ESCAPES)


@dataclass(frozen=True, slots=True)
class SessionKeys:
    meta: str
    subs: str
    inbox: str
    wake: str


class Keys:
    """Names under ``prefix``. Pure: no I/O."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self.epoch = f"{prefix}:epoch"
        self.partitions = f"{prefix}:partitions"
        self.partitioning = f"{prefix}:partitioning"
        self.registry = f"{prefix}:registry"
        self.session_registry = f"{prefix}:registry:sessions"
        self.broadcast = f"{prefix}:bcast"
        self.fanout_consumers = f"{prefix}:fanout"

    def session(self, session_id: str) -> SessionKeys:
        base = f"{self.prefix}:{{s:{session_id}}}"
        return SessionKeys(base + ":meta", base + ":subs", base + ":inbox", base + ":wake")

    def inbox_keys(self, session_id: str) -> tuple[str, str, str]:
        """``session``'s meta, inbox and wake keys, the keys of an inbox append (one call per frame
        on the fan-out path: no ``SessionKeys`` built)."""
        base = f"{self.prefix}:{{s:{session_id}}}"
        return base + ":meta", base + ":inbox", base + ":wake"

    def node_wake(self, node: str) -> str:
        """The channel of one worker process: frame wake-ups of the sessions it watches (single node)."""
        return f"{self.prefix}:{{w:{node}}}:wake"

    def tenant_sessions(self, tenant: str) -> str:
        return f"{self.prefix}:{{t:{escape_tenant(tenant)}}}:sessions"

    def quota(self, tenant: str, kind: str) -> str:
        """A tenant's quota state: its places of ``kind`` (zset), or a bucket (hash; ``kind`` ``rate``:
        publishing, ``verify``: webhook verifications)."""
        return f"{self.prefix}:{{t:{escape_tenant(tenant)}}}:q:{kind}"

    def index(self, tenant: str, uri: str) -> str:
        # The tenant part holds no ':', so the first ':' after it ends it: injective.
        return f"{self.prefix}:{{i:{escape_tenant(tenant)}:{uri}}}"

    def log(self, partition: int) -> str:
        return f"{self.prefix}:{{c:{partition}}}:log"

    def lease(self, partition: int) -> str:
        """Which fan-out consumer holds the partition (it alone reads it, so changes keep their order)."""
        return f"{self.prefix}:{{c:{partition}}}:lease"

    def sealed(self, partition: int) -> str:
        """Set when the partition takes no more appends: a switch of layouts drains it."""
        return f"{self.prefix}:{{c:{partition}}}:sealed"

    def named_lease(self, name: str) -> str:
        """The owner of a named lease: one key per lease, no hash tag (every call touches one key)."""
        return f"{self.prefix}:lease:{name}"

    def backlog(self, partition: int) -> str:
        """Per tenant, how many of the partition's changes fan-out has not processed yet."""
        return f"{self.prefix}:{{c:{partition}}}:backlog"

    def records(self, partition: int, tenant: str, collection: str) -> str:
        return f"{self.prefix}:{{c:{partition}}}:rec:{escape_tenant(tenant)}/{collection}"

    def record_ids(self, partition: int, tenant: str, collection: str) -> str:
        return f"{self.prefix}:{{c:{partition}}}:ids:{escape_tenant(tenant)}/{collection}"

    def collections(self, partition: int, tenant: str) -> str:
        return f"{self.prefix}:{{c:{partition}}}:cols:{escape_tenant(tenant)}"

    def record_usage(self, partition: int, tenant: str) -> str:
        """The tenant's record count and bytes, kept by the scripts that write and delete records."""
        return f"{self.prefix}:{{c:{partition}}}:use:{escape_tenant(tenant)}"

    def credential(self, key_id: str) -> str:
        return f"{self.prefix}:{{k}}:key:{key_id}"

    def credential_digest(self, digest: str) -> str:
        return f"{self.prefix}:{{k}}:digest:{digest}"

    def credential_ids(self, tenant: str | None = None) -> str:
        """Every key's id (``tenant`` None), or one tenant's."""
        base = f"{self.prefix}:{{k}}:ids"
        return base if tenant is None else f"{base}:{escape_tenant(tenant)}"
