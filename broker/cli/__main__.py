"""``python -m broker.cli``: the ``mcp-broker`` command, with its exit status."""

import sys

from broker.cli import main

sys.exit(main())
