"""`python -m asyncckpt ...`: see asyncckpt.cli."""

from .cli.commands import main

raise SystemExit(main())
