"""Pure protocol layer: JSON-RPC framing, MCP versions, errors and message builders.

Nothing here does I/O or touches asyncio; transports and the core call into it.
"""
