"""Feeds: the one mechanism behind a 2025 session, a resumable listen, an events poll and a webhook.

A feed is a record bound to the principal that made it, with a kind (``FeedKind``), a filter
(``Filter``: what it watches, None for a session, whose subscriptions are its client's), and an
inbox that fan-out fills. A position in it is a ``Cursor``, ``<id>:<epoch>-<offset>``.
``model`` holds these types (pure, so the backends store them); ``service.Feeds`` creates,
loads, resumes and ends feeds, with every quota and capacity check in one place; ``reader``
holds the one loop that reads a feed (read, gap or gone, resync, advance) and the rule for a
feed that is gone, per kind. The four features are views over that loop: ``session``
(``SessionStream``, a 2025 session's GET stream, SSE or stdio), ``listen`` (``ResumableListen``),
``poll`` (``PollPage``, one ``events/poll`` page) and ``webhook`` (``WebhookPush``).

This package's ``__init__`` imports nothing: the backends import ``broker.feeds.model``.
"""
