"""`python -m asyncckpt ...`: see asyncckpt.cli."""

from .cli import main

raise SystemExit(main())
