"""``python -m broker.cli``: the ``mcp-broker`` command."""

from broker.cli import main

if __name__ == "__main__":
    main()
