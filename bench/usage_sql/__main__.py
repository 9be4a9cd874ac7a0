"""`python -m bench.usage_sql`: the benchmark of run.py (`--help` lists its options)."""

import os

from bench.usage_sql.run import main

os.environ.setdefault("PYTHONHASHSEED", "0")
raise SystemExit(main())
