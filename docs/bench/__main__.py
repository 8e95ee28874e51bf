"""`python -m docs.bench`: the throughput benchmark (docs/bench/bench.py)."""

import sys

from docs.bench.bench import main

sys.exit(main())
