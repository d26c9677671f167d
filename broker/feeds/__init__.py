"""Feeds: the one mechanism behind a 2025 session, a resumable listen, an events poll and a webhook.

A feed is a record bound to the principal that made it, with a kind (``FeedKind``), a filter
(``Filter``: what it watches, None for a session, whose subscriptions are its client's), and an
inbox that fan-out fills. A position in it is a ``Cursor``, ``<id>:<epoch>-<offset>``.
``model`` holds these types (pure, so the backends store them); ``service.Feeds`` creates,
loads, resumes and ends feeds, with every quota and capacity check in one place.

This package's ``__init__`` imports nothing: the backends import ``broker.feeds.model``.
"""
