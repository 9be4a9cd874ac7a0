"""`python -m sim [serve] [MODEL] [vLLM flags]`: see sim/server.py."""

from sim.server import main

raise SystemExit(main())
