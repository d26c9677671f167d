"""MCP servers behind the broker (``MCP_BROKER_UPSTREAMS``, docs/UPSTREAMS.md).

``spec``: the setting, read and checked once. ``client``: JSON-RPC to one upstream in either era,
over Streamable HTTP (``streamable``) or to its process (``stdio``), with the broker's own
credentials (``auth``); what can go wrong is ``errors``. ``watch``: the one watch of an upstream's
URIs for the whole deployment. ``service``: what the MCP methods ask of them.
"""
